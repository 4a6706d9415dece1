"""The run's tables (latency, writes per job by window, Events, CPU by process, the heap at its peak)
and its RESULT line, whose keys other tools and docs/benchmarks.md read: change a key only with them.
"""

from __future__ import annotations

import argparse
import math
import os
from collections import Counter
from pathlib import Path
from typing import Any

from lib import common, heap

from operator_scale.cluster import OPERATOR_NS
from operator_scale.measures import percentile
from operator_scale.phases import BURST_NS, SOLO_NS, Phase
from operator_scale.run import Plan, Run
from operator_scale.watch import in_window, kind_of


def report(args: argparse.Namespace, plan: Plan, run: Run) -> None:
    solo, burst = run.solo, run.burst
    windows = {
        SOLO_NS: in_window(run.writes, SOLO_NS, solo.start, solo.end),
        BURST_NS: in_window(run.writes, BURST_NS, burst.start, burst.end),
    }
    latency_table(args, run)
    b_parts = writes_table(args, run, windows)
    events_table(run)
    cpu_table(burst)
    notes(args, run, windows)
    heap_peak = heap_table(args.operator_memray) if args.operator_memray else 0
    n_burst = len(burst.latency)
    s_lat, b_lat = list(solo.latency.values()), list(burst.latency.values())
    steady_s = burst.end - burst.running_done
    steady = sum(b_parts[2].values()) / n_burst / steady_s * 60
    common.result(
        {
            "p50_s": rounded(percentile(b_lat, 50), 3),
            "p99_s": rounded(percentile(b_lat, 99), 3),
            "api_floor_s": rounded(run.floor.total_s(), 3),
            "api_floor_p99_s": rounded(percentile(run.floor.latencies(), 99), 3),
            "p99_over_api_floor": rounded(percentile(b_lat, 99) / run.floor.total_s(), 2),
            "writes_per_job": rounded(len(windows[BURST_NS]) / n_burst, 2),
            # the same without requests the API server refused (409 duplicates, kopf's 422 stale-finalizer
            # patch): what was written
            "applied_writes_per_job": rounded(
                sum(1 for e in windows[BURST_NS] if e.get("responseStatus", {}).get("code", 200) < 300)
                / n_burst,
                2,
            ),
            "writes_window_s": rounded(burst.end - burst.start, 1),
            "steady_writes_per_job_per_min": rounded(steady, 2),
            "solo_p50_s": rounded(percentile(s_lat, 50), 3),
            "solo_writes_per_job": rounded(len(windows[SOLO_NS]) / max(len(solo.latency), 1), 2),
            "jobs": n_burst,
            "nodes": plan.nodes,
            "node_gpus": plan.shape.gpus,
            "qps": args.qps,
            "qps_achieved": rounded(burst.create_rate(), 1),
            "last_cluster_s": rounded(burst.clusters_done - burst.start, 1),
            "all_running_s": rounded(burst.running_done - burst.start, 1),
            "running_p50_s": rounded(percentile(list(burst.to_running.values()), 50), 2),
            "running_p99_s": rounded(percentile(list(burst.to_running.values()), 99), 2),
            "operator_rss_mib": rounded(run.rss["rlhf operator"], 1),
            "operator_rss_end_mib": rounded(run.rss["rlhf operator now"], 1),
            "operator_cpu_steady_cores": rounded(burst.cores("rlhf operator", 2, 3), 3),
            "operator_cpu_burst_cores": rounded(burst.cores("rlhf operator", 0, 2), 3),
            "apiserver_cpu_steady_cores": rounded(burst.cores("kube-apiserver", 2, 3), 3),
            "apiserver_cpu_to_clusters_cores": rounded(burst.cores("kube-apiserver", 0, 1), 3),
            "apiserver_cpu_to_running_cores": rounded(burst.cores("kube-apiserver", 1, 2), 3),
            "apiserver_cpu_idle_cores": rounded(run.idle.cores("kube-apiserver", 0, 1), 3),
            "apiserver_rss_mib": rounded(run.rss["kube-apiserver"], 1),
            "settle_s": rounded(steady_s, 1),
            "solo": len(solo.latency),
            "reconcile_interval_s": args.reconcile_interval,
            "operator_env": dict(args.operator_env),
            **({"operator_heap_peak_mib": rounded(heap_peak / 2**20, 1)} if heap_peak else {}),
        }
    )


def heap_table(capture: Path, limit: int = 25) -> int:
    """The operator's heap at its peak by allocation site (memray); returns the peak in bytes."""
    peak, sites = heap.peak_sites(capture)
    rest = sites[limit:]
    common.table(
        f"Operator heap at its peak: {peak / 2**20:.1f} MiB, by allocation site (memray, {capture})",
        ["MiB", "blocks", "allocated in", "owners (innermost first, outside the standard library)"],
        [
            *[[s.size / 2**20, s.count, s.allocated_in, "\n".join(s.owners)] for s in sites[:limit]],
            [sum(s.size for s in rest) / 2**20, sum(s.count for s in rest), f"{len(rest)} more sites", ""],
        ],
    )
    return peak


def rounded(x: float, digits: int) -> float | None:
    """For the RESULT line: NaN (no samples, e.g. --solo 0) as null, which strict JSON parsers accept."""
    return None if math.isnan(x) else round(x, digits)


def latency_table(args: argparse.Namespace, run: Run) -> None:
    solo, burst = run.solo, run.burst
    s_lat, b_lat = list(solo.latency.values()), list(burst.latency.values())
    s_run, b_run = list(solo.to_running.values()), list(burst.to_running.values())
    rate = f"at {args.qps:g}/s" if args.qps > 0 else "unpaced"
    common.table(
        "Create -> RayCluster exists, and -> Running (seconds; the client's clock before the POST to the "
        "watch event)",
        ["", f"one at a time (n={len(s_lat)})", f"{len(b_lat)} {rate}"],
        [
            *[[f"RayCluster p{q}", percentile(s_lat, q), percentile(b_lat, q)] for q in (50, 90, 99)],
            ["RayCluster max", max(s_lat, default=math.nan), max(b_lat)],
            *[[f"Running p{q}", percentile(s_run, q), percentile(b_run, q)] for q in (50, 99)],
            ["jobs created per second (first POST to last)", solo.create_rate(), burst.create_rate()],
            [
                "last RayCluster after first create",
                solo.clusters_done - solo.start,
                burst.clusters_done - burst.start,
            ],
            [
                "every job Running after first create",
                solo.running_done - solo.start,
                burst.running_done - burst.start,
            ],
            ["final phases", dict(run.final[SOLO_NS]), dict(run.final[BURST_NS])],
        ],
    )
    floor = run.floor
    common.table(
        "The API server's own limit (api_floor_s): as many RayCluster creates, at the same rate and from as "
        "many threads, straight to the API server; goal at 100 jobs: p99_s <= 1.5 x api_floor_s",
        ["", "seconds"],
        [
            ["first POST to the last create's answer (api_floor_s)", floor.total_s()],
            *[[f"one create, p{q}", percentile(floor.latencies(), q)] for q in (50, 99)],
            ["the burst's RayCluster p99 over api_floor_s", percentile(b_lat, 99) / floor.total_s()],
        ],
    )


def split(ph: Phase, evs: list[dict[str, Any]]) -> list[Counter[str]]:
    """Writes by kind in three windows: create -> last RayCluster, -> all Running, the settle window."""
    parts: list[Counter[str]] = [Counter(), Counter(), Counter()]
    for e in evs:
        parts[0 if e["_t"] < ph.clusters_done else 1 if e["_t"] < ph.running_done else 2][kind_of(e)] += 1
    return parts


def writes_table(
    args: argparse.Namespace, run: Run, windows: dict[str, list[dict[str, Any]]]
) -> list[Counter[str]]:
    """Writes per job by resource and verb in each window; returns the burst's split."""
    n_solo, n_burst = max(len(run.solo.latency), 1), len(run.burst.latency)
    s_parts, b_parts = split(run.solo, windows[SOLO_NS]), split(run.burst, windows[BURST_NS])
    rows: list[list[Any]] = []
    for k in sorted(set().union(*s_parts, *b_parts)):
        rows.append(
            [k]
            + [s_parts[i][k] / n_solo for i in range(3)]
            + [sum(c[k] for c in s_parts) / n_solo]
            + [b_parts[i][k] / n_burst for i in range(3)]
            + [sum(c[k] for c in b_parts) / n_burst]
        )
    tot = ["total"] + [sum(s_parts[i].values()) / n_solo for i in range(3)] + [len(windows[SOLO_NS]) / n_solo]
    tot += [sum(b_parts[i].values()) / n_burst for i in range(3)] + [len(windows[BURST_NS]) / n_burst]
    rows.append(tot)
    s_win, b_win = run.solo.end - run.solo.start, run.burst.end - run.burst.start
    common.table(
        f"Operator API writes per job (audit log, ServiceAccount {OPERATOR_NS}/rlhf-operator). Windows: "
        f"to last RayCluster | to all Running | {args.settle:.0f} s settle; whole window "
        f"{s_win:.0f} s (solo), {b_win:.0f} s (burst)",
        [
            "verb resource",
            "solo: ->cluster",
            "->Running",
            "settle",
            "solo total",
            "burst: ->cluster",
            "->Running",
            "settle",
            "burst total",
        ],
        rows,
    )
    return b_parts


def events_table(run: Run) -> None:
    n_solo, n_burst = max(len(run.solo.latency), 1), len(run.burst.latency)
    reasons = sorted(set(run.events[SOLO_NS]) | set(run.events[BURST_NS]))
    common.table(
        "Events about RLHFJobs per job, by reason (the `create events` rows; whole run)",
        ["reason (kopf's `Logging` Events: the message)", "solo", "burst"],
        [[r, run.events[SOLO_NS][r] / n_solo, run.events[BURST_NS][r] / n_burst] for r in reasons],
    )


def cpu_table(burst: Phase) -> None:
    """Where the time goes: CPU seconds and mean cores per process in each window of the burst."""
    nproc = os.cpu_count() or 1
    procs = sorted(burst.cpu[0], key=lambda k: -burst.cpu_used(k, 0, 3))
    windows = [(0, 1), (1, 2), (2, 3)]
    rows: list[list[Any]] = []
    for k in procs:
        rows.append([k, *[x for i, j in windows for x in (burst.cpu_used(k, i, j), burst.cores(k, i, j))]])
    total = [sum(burst.cpu_used(k, i, j) for k in procs) for i, j in windows]
    walls = [burst.marks[j] - burst.marks[i] for i, j in windows]
    rows.append(["all of the above", *[x for t, w in zip(total, walls, strict=True) for x in (t, t / w)]])
    rows.append([f"machine capacity ({nproc} CPUs)", *[x for w in walls for x in (w * nproc, float(nproc))]])
    common.table(
        "Burst: CPU seconds and mean cores by process (where the time goes); windows of "
        + ", ".join(f"{w:.0f} s" for w in walls),
        ["process", "create -> last RayCluster", "cores", "-> all Running", "cores", "settle", "cores"],
        rows,
    )


def notes(args: argparse.Namespace, run: Run, windows: dict[str, list[dict[str, Any]]]) -> None:
    rate = run.burst.create_rate()
    if args.qps > 0 and rate < 0.9 * args.qps:
        common.console.print(
            f"[yellow]the burst was created at {rate:.0f} jobs/s, not {args.qps:g}: POSTs took longer than "
            "client threads / qps seconds; raise --parallel[/yellow]"
        )
    failed = Counter(
        f"{kind_of(e)} {e['responseStatus'].get('code')}"
        for evs in windows.values()
        for e in evs
        if e.get("responseStatus", {}).get("code", 200) >= 300
    )
    if failed:
        common.console.print(f"[yellow]non-2xx operator writes (counted above): {dict(failed)}[/yellow]")
    elsewhere = [e for e in run.writes if e.get("objectRef", {}).get("namespace") not in (SOLO_NS, BURST_NS)]
    common.console.print(
        f"[dim]operator writes outside the job namespaces (not per job): {dict(Counter(kind_of(e) for e in elsewhere))}[/dim]"
    )
    idle = ", ".join(f"{p} {run.idle.cores(p, 0, 1):.3f}" for p in ("kube-apiserver", "etcd", "kwok"))
    common.console.print(f"[dim]cores before the operator started (nodes up, no jobs): {idle}[/dim]")
    a = run.audit
    common.console.print(
        f"[dim]audit log read while written: {a.bytes / 2**20:.0f} MiB, {a.entries} entries (all users), "
        f"{a.rotations} rotation(s) followed; operator peak RSS {run.rss['rlhf operator']:.0f} MiB, "
        f"kube-apiserver {run.rss['kube-apiserver']:.0f} MiB[/dim]"
    )
