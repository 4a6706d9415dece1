"""One group of jobs through its life: created one at a time or at a paced rate, every RayCluster
seen, every job Running, then a settle window, with the CPU of every process at each mark.
"""

from __future__ import annotations

import math
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from lib import common

from operator_scale.cluster import ROOT, WORK
from operator_scale.measures import cpu_seconds, progress
from operator_scale.watch import Watcher

SOLO_NS, BURST_NS, FLOOR_NS = "bench-solo", "bench-burst", "bench-floor"


def job_template(port: int) -> dict[str, Any]:
    """examples/rlhfjob-tiny.yaml with its trainer metrics served by the stand-in."""
    import yaml

    doc: dict[str, Any] = yaml.safe_load((ROOT / "examples" / "rlhfjob-tiny.yaml").read_text())
    doc["metadata"] = {"name": "tiny", "namespace": "default"}
    doc["spec"]["monitoring"].update(metricsPort=port, stallTimeoutSeconds=3600)
    return doc


def job_body(template: dict[str, Any], name: str, namespace: str) -> dict[str, Any]:
    return {**template, "metadata": {"name": name, "namespace": namespace}}


@dataclass
class Phase:
    """One group of jobs: when each was created, when its RayCluster appeared and when it was Running."""

    namespace: str
    created: dict[str, float] = field(default_factory=dict)
    latency: dict[str, float] = field(default_factory=dict)
    to_running: dict[str, float] = field(default_factory=dict)
    start: float = 0.0
    clusters_done: float = 0.0
    running_done: float = 0.0
    end: float = 0.0
    # CPU seconds of each process, and the wall time, at start, last RayCluster, all Running, end.
    cpu: list[dict[str, float]] = field(default_factory=list)
    marks: list[float] = field(default_factory=list)

    def checkpoint(self, pids: dict[str, int]) -> float:
        self.cpu.append(cpu_seconds(pids))
        self.marks.append(time.time())
        return self.marks[-1]

    def cpu_used(self, proc: str, i: int, j: int) -> float:
        """CPU seconds `proc` used between checkpoints i and j."""
        return self.cpu[j].get(proc, 0.0) - self.cpu[i].get(proc, 0.0)

    def cores(self, proc: str, i: int, j: int) -> float:
        """`proc`'s mean cores between checkpoints i and j."""
        return self.cpu_used(proc, i, j) / max(self.marks[j] - self.marks[i], 1e-9)

    def create_rate(self) -> float:
        """Jobs POSTed per second, first POST to last."""
        ts = sorted(self.created.values())
        return (len(ts) - 1) / (ts[-1] - ts[0]) if len(ts) > 1 and ts[-1] > ts[0] else float("nan")


def phases_of(custom: Any, namespace: str) -> Counter[str]:
    items = custom.list_namespaced_custom_object("rlhf.dev", "v1alpha1", namespace, "rlhfjobs")["items"]
    return Counter(str(i.get("status", {}).get("phase") or "(none)") for i in items)


def event_reasons(core: Any, namespace: str) -> Counter[str]:
    """The Events about RLHFJobs (all posted by the operator), by reason: what the `create events` are."""
    out: Counter[str] = Counter()
    for ev in core.list_namespaced_event(namespace).items:
        if ev.involved_object.kind == "RLHFJob":
            msg = ev.message if ev.reason == "Logging" else ""  # kopf's own log lines, posted as Events
            out[f"{ev.reason} {msg}".strip()[:60]] += ev.count or 1
    return out


def create_paced(names: list[str], create: Callable[[str], None], qps: float, threads: int) -> None:
    """POST on a fixed schedule, job i at i/qps seconds after the first (qps 0: as fast as possible), from
    `threads` client threads each taking the next job in turn."""
    t0 = time.monotonic()
    queue = iter(enumerate(names))
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                item = next(queue, None)
            if item is None:
                return
            i, name = item
            if qps > 0 and (delay := t0 + i / qps - time.monotonic()) > 0:
                time.sleep(delay)
            create(name)

    with ThreadPoolExecutor(threads) as pool:
        for f in [pool.submit(worker) for _ in range(threads)]:
            f.result()


def wait_timeout(jobs: int) -> float:
    """How long a phase may take to get every RayCluster, then every job Running: 600 s for 100 jobs,
    3,300 s for 1,000."""
    return 300 + 3 * jobs


@dataclass
class Bench:
    """What a phase needs: the watches, the API, the job template, the processes to account and check."""

    watch: Watcher
    custom: Any
    template: dict[str, Any]
    pids: dict[str, int]
    operator: subprocess.Popen[bytes]

    def check(self) -> None:
        """Give up at once if the operator died or a job failed (a long wait would only time out)."""
        if self.operator.poll() is not None:
            raise RuntimeError(
                f"the operator exited ({self.operator.returncode}); see {WORK / 'operator.log'}"
            )
        failed = [k for k, phase in self.watch.phases.items() if phase == "Failed"]
        if failed:
            raise RuntimeError(f"{len(failed)} job(s) Failed, e.g. {failed[0]}; see {WORK / 'operator.log'}")


def run_phase(b: Bench, ph: Phase, names: list[str], qps: float, threads: int, settle: float) -> None:
    """Create the jobs (threads 1: each after the previous one's RayCluster exists, plus 1 s; otherwise at
    `qps`), wait for their clusters and for every job to be Running, then let the operator run `settle`
    more seconds."""
    from rlhf_operator.manifests import raycluster_name

    ns, n = ph.namespace, len(names)
    keys = {name: (ns, raycluster_name(name)) for name in names}
    jobs = [(ns, name) for name in names]

    def create(name: str) -> None:
        body = job_body(b.template, name, ns)
        ph.created[name] = time.time()  # before the POST
        b.custom.create_namespaced_custom_object("rlhf.dev", "v1alpha1", ns, "rlhfjobs", body)

    ph.start = ph.checkpoint(b.pids)
    w, timeout = b.watch, wait_timeout(n)
    with progress(lambda: f"{ns}: {len(ph.created)}/{n} created, {w.summary(ns, n)}"):
        if threads == 1:
            for name in names:
                create(name)
                w.wait_for(w.seen([keys[name]]), 120, f"RayCluster of {name}", b.check)
                time.sleep(1.0)  # the operator goes idle again before the next one
        else:
            create_paced(names, create, qps, threads)
        w.wait_for(w.seen(list(keys.values())), timeout, f"{ns}: every RayCluster", b.check)
        ph.checkpoint(b.pids)
        w.wait_for(w.all_running(jobs), timeout, f"{ns}: every job Running", b.check)
        ph.running_done = ph.checkpoint(b.pids)
    ph.clusters_done = max((b.watch.clusters[k] for k in keys.values()), default=ph.start)
    ph.latency = {name: b.watch.clusters[keys[name]] - ph.created[name] for name in names}
    ph.to_running = {name: b.watch.running[(ns, name)] - ph.created[name] for name in names}
    common.console.print(f"[dim]{ns}: all {n} Running; {settle:.0f} s of steady state ...[/dim]")
    time.sleep(settle)
    b.check()
    ph.end = ph.checkpoint(b.pids)


@dataclass
class Floor:
    """The bare API server's own limit: as many RayCluster creates as the burst's jobs, at its rate and
    from as many client threads, straight to the API server (no operator in the path)."""

    started: dict[str, float] = field(default_factory=dict)
    answered: dict[str, float] = field(default_factory=dict)

    def total_s(self) -> float:
        """First POST to the last create's answer: what `api_floor_s` reports."""
        return max(self.answered.values()) - min(self.started.values()) if self.answered else math.nan

    def latencies(self) -> list[float]:
        return [self.answered[k] - self.started[k] for k in self.answered]


def floor_body(custom: Any, namespace: str) -> dict[str, Any]:
    """One of the operator's RayClusters (from the solo phase), as a new object for FLOOR_NS: no owner,
    no labels the operator selects by, and suspended, so KubeRay makes no pods for it and the floor is
    the API server accepting the same object, not the cluster starting."""
    items = custom.list_namespaced_custom_object("ray.io", "v1", namespace, "rayclusters")["items"]
    if not items:
        raise RuntimeError(f"no RayCluster in {namespace} to copy for the API server's floor")
    src = items[0]
    spec = {**src["spec"], "suspend": True}
    return {
        "apiVersion": src["apiVersion"],
        "kind": src["kind"],
        "metadata": {"labels": {"bench": "floor"}},
        "spec": spec,
    }


def api_floor(custom: Any, body: dict[str, Any], n: int, qps: float, threads: int) -> Floor:
    """`n` RayCluster creates at `qps` from `threads` threads (create_paced, as the burst's jobs)."""
    floor = Floor()

    def create(name: str) -> None:
        obj = {**body, "metadata": {**body["metadata"], "name": name, "namespace": FLOOR_NS}}
        floor.started[name] = time.time()
        custom.create_namespaced_custom_object("ray.io", "v1", FLOOR_NS, "rayclusters", obj)
        floor.answered[name] = time.time()

    width = max(3, len(str(n - 1)))
    common.console.print(f"[dim]the API server's floor: {n} RayCluster creates at {qps:g}/s ...[/dim]")
    create_paced([f"floor-{i:0{width}d}" for i in range(n)], create, qps, threads)
    return floor


def idle_baseline(pids: dict[str, int], seconds: float = 10.0) -> Phase:
    """The control plane's CPU with every node up but no operator or job yet: KWOK renews each node's
    Lease every 10 s, which the API server and etcd serve in every window below too."""
    common.console.print(f"[dim]{seconds:.0f} s idle (the control plane's CPU with no jobs) ...[/dim]")
    idle = Phase("idle")
    idle.checkpoint(pids)
    time.sleep(seconds)
    idle.checkpoint(pids)
    return idle
