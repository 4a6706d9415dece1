"""One measured run: the plan made before the control plane starts, the set-up, the operator (as
the chart's ServiceAccount, with the stand-in as every head), the solo then the burst phase, and what
was measured.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from lib import common, heap

import devcluster
from operator_scale.cluster import (
    ROOT,
    STATE,
    WORK,
    api_clients,
    free_port,
    install_rbac,
    kubectl,
    operator_kubeconfig,
    process,
    wait_http,
)
from operator_scale.measures import rss_mib
from operator_scale.nodes import NodeShape, add_nodes, job_pod_gpus, plan_nodes
from operator_scale.phases import (
    BURST_NS,
    FLOOR_NS,
    SOLO_NS,
    Bench,
    Floor,
    Phase,
    api_floor,
    event_reasons,
    floor_body,
    idle_baseline,
    job_template,
    phases_of,
    run_phase,
)
from operator_scale.watch import AuditTail, Watcher, kind_of

SCRIPT = ROOT / "benchmarks" / "operator_scale.py"  # the stand-in is this script in a child process


@dataclass
class Plan:
    """What the run is set to do, decided before the control plane starts."""

    nodes: int
    shape: NodeShape
    threads: int
    port: int  # the stand-in Ray dashboard and trainer /metrics
    health: int  # the operator's liveness endpoint
    template: dict[str, Any]
    pod_gpus: list[int]


@dataclass
class Run:
    """What the run measured."""

    solo: Phase
    burst: Phase
    writes: list[dict[str, Any]]
    final: dict[str, Counter[str]]
    events: dict[str, Counter[str]]
    rss: dict[str, float]
    audit: AuditTail
    idle: Phase
    floor: Floor


def make_plan(args: argparse.Namespace) -> Plan:
    template = job_template(free_port())
    pod_gpus = job_pod_gpus(template)
    nodes, shape = plan_nodes(args.nodes, pod_gpus, args.jobs + args.solo)
    # Open loop: enough threads that each POST starts on schedule while up to 1 s of earlier ones are still
    # being served (the API server took 0.3-0.9 s per RLHFJob POST at 100/s on 2 cores).
    threads = args.parallel or max(8, math.ceil(args.qps))
    port = int(template["spec"]["monitoring"]["metricsPort"])
    return Plan(nodes, shape, threads, port, free_port(), template, pod_gpus)


def prepare(core: Any, plan: Plan) -> tuple[str, Path]:
    """The CRD, the nodes, the operator's RBAC and token, the namespaces; returns (user name, kubeconfig)."""
    crd = ROOT / "crds" / "rlhfjobs.rlhf.dev.yaml"
    kubectl("apply", "--server-side", "--force-conflicts", "-f", str(crd))
    add_nodes(core, plan.nodes, plan.shape)  # meanwhile the CRD's status gets its conditions
    kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd/rlhfjobs.rlhf.dev")
    username = install_rbac()
    kubeconfig = operator_kubeconfig(username)
    for ns in (SOLO_NS, BURST_NS, FLOOR_NS):
        kubectl("create", "namespace", ns)
    return username, kubeconfig


def operator_env(
    args: argparse.Namespace, base: dict[str, str], kubeconfig: Path, port: int
) -> dict[str, str]:
    """The operator's environment: the development head override (every RayCluster's "head" is the
    stand-in), then --reconcile-interval, then each --operator-env KEY=VALUE."""
    env = {
        **base,
        "KUBECONFIG": str(kubeconfig),
        "RLHF_DEV_HEAD_HOST": "127.0.0.1",
        "RLHF_DEV_DASHBOARD_PORT": str(port),
    }
    if args.reconcile_interval is not None:
        env["RLHF_RECONCILE_INTERVAL"] = f"{args.reconcile_interval:g}"
    env.update(dict(args.operator_env))
    return env


def operator_cmd(args: argparse.Namespace, plan: Plan) -> list[str]:
    cmd = ["operator", "--all-namespaces", "--metrics-port", "0"]
    cmd += ["--liveness", f"http://127.0.0.1:{plan.health}/healthz"]
    cmd += ["--verbose"] if args.operator_verbose else []
    if args.operator_memray:
        return heap.memray_command(sys.executable, "rlhf_cli.main", cmd, args.operator_memray)
    return [str(Path(sys.executable).parent / "rlhf"), *cmd]


def run_phases(args: argparse.Namespace, plan: Plan, b: Bench) -> tuple[Phase, Phase, Floor]:
    """The solo jobs one at a time, the API server's floor (the burst's creates as RayClusters straight
    to the API server, while the operator idles), then the burst at --qps; returns (solo, burst, floor)."""
    solo, burst = Phase(SOLO_NS), Phase(BURST_NS)
    common.console.print(f"[dim]{args.solo} jobs one at a time ...[/dim]")
    run_phase(b, solo, [f"solo-{i}" for i in range(args.solo)], 0, 1, args.settle)
    floor = api_floor(b.custom, floor_body(b.custom, SOLO_NS), args.jobs, args.qps, plan.threads)
    time.sleep(5.0)  # KubeRay's status writes for the suspended copies pass before the burst
    common.console.print(f"[dim]{args.jobs} jobs at {args.qps:g} jobs/s ...[/dim]")
    width = max(3, len(str(args.jobs - 1)))
    names = [f"job-{i:0{width}d}" for i in range(args.jobs)]
    run_phase(b, burst, names, args.qps, plan.threads, args.settle)
    b.check()
    return solo, burst, floor


def measure(args: argparse.Namespace, plan: Plan) -> Run:
    custom, core = api_clients(plan.threads)
    username, kubeconfig = prepare(core, plan)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RLHF_", "KUBECONFIG"))}
    stand_in = [sys.executable, str(SCRIPT), "--serve-stand-in", str(plan.port)]
    state = cast(dict[str, Any], devcluster.read_state() or {})
    pids = {str(k): int(v) for k, v in state["pids"].items()}
    idle = idle_baseline(pids)
    audit = AuditTail(STATE / "logs" / "audit.log", username)
    audit.start()
    try:
        with (
            process(stand_in, env, WORK / "stand-in.log") as si,
            process(
                operator_cmd(args, plan),
                operator_env(args, env, kubeconfig, plan.port),
                WORK / "operator.log",
            ) as op,
        ):
            wait_http(f"http://127.0.0.1:{plan.port}/metrics", 30, si, "the stand-in Ray dashboard")
            wait_http(f"http://127.0.0.1:{plan.health}/healthz", 60, op, "the operator")
            watch = Watcher(STATE / "kubeconfig")
            watch.start()
            pids.update({"rlhf operator": op.pid, "stand-in Ray": si.pid})
            solo, burst, floor = run_phases(args, plan, Bench(watch, custom, plan.template, pids, op))
            rss = {p: rss_mib(pids[p]) for p in ("rlhf operator", "kube-apiserver")}
            rss["rlhf operator now"] = rss_mib(op.pid, "VmRSS")
            final = {ns: phases_of(custom, ns) for ns in (SOLO_NS, BURST_NS)}
            events = {ns: event_reasons(core, ns) for ns in (SOLO_NS, BURST_NS)}
            watch.stop.set()
    finally:
        time.sleep(1.0)  # the audit log is written asynchronously (batch backend off: within ms)
        audit.close()
    with (WORK / "operator-writes.jsonl").open("w") as f:
        for e in audit.writes:
            f.write(json.dumps(e) + "\n")
    refused = [e for e in audit.writes if e.get("responseStatus", {}).get("code") == 403]
    if refused:
        raise RuntimeError(
            f"the API server refused {len(refused)} operator writes, e.g. {kind_of(refused[0])}"
        )
    return Run(solo, burst, audit.writes, final, events, rss, audit, idle, floor)
