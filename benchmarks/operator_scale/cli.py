"""The command line: `python benchmarks/operator_scale.py [--jobs N] [--qps R] ...` (the script is
its only entry point, also for the stand-in child); it prints the tables and one RESULT line.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

from lib import common

import devcluster
import operator_scale
from operator_scale.cluster import STATE, WORK
from operator_scale.report import report
from operator_scale.run import Plan, make_plan, measure
from operator_scale.stand_in import serve_stand_in


def env_pair(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(operator_scale.__doc__ or "").splitlines()[0])
    p.add_argument("--jobs", type=int, default=100, help="RLHFJobs created in the burst")
    p.add_argument(
        "--nodes", type=int, help="KWOK nodes shaped like a real 8-GPU machine (default: a few huge nodes)"
    )
    p.add_argument("--qps", type=float, default=100.0, help="burst creation rate, jobs/s (0: unpaced)")
    p.add_argument("--parallel", type=int, help="client threads creating the burst (default: qps, >= 8)")
    p.add_argument("--solo", type=int, default=5, help="RLHFJobs created one at a time first (idle operator)")
    p.add_argument(
        "--settle", type=float, default=30.0, help="seconds the operator runs on after all are Running"
    )
    p.add_argument(
        "--reconcile-interval",
        type=float,
        help="RLHF_RECONCILE_INTERVAL (seconds) for the operator (default: unset, the operator's own)",
    )
    p.add_argument(
        "--operator-env",
        type=env_pair,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="more operator environment, after --reconcile-interval (repeatable)",
    )
    p.add_argument("--operator-verbose", action="store_true", help="kopf debug log (its patches) in the log")
    p.add_argument(
        "--operator-memray",
        type=Path,
        metavar="FILE",
        help="run the operator under memray (pip install memray), write its capture to FILE and report the "
        "allocation sites live at the heap's peak (slows the operator)",
    )
    p.add_argument("--keep-cluster", action="store_true", help="leave the control plane up (for inspection)")
    p.add_argument("--serve-stand-in", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.jobs < 1 or args.solo < 0 or args.qps < 0 or (args.nodes is not None and args.nodes < 1):
        p.error("--jobs and --nodes must be at least 1, --solo and --qps at least 0")
    if args.operator_memray and importlib.util.find_spec("memray") is None:
        p.error("--operator-memray needs memray: .venv/bin/pip install memray")
    return args


def header(args: argparse.Namespace, plan: Plan) -> None:
    rate = f"{args.qps:g} jobs/s" if args.qps > 0 else "unpaced"
    interval = f"{args.reconcile_interval:g} s" if args.reconcile_interval is not None else "operator default"
    extra = " ".join(f"{k}={v}" for k, v in args.operator_env) or "none"
    common.console.print(
        f"operator_scale: {args.jobs} jobs at {rate} ({plan.threads} client threads) after {args.solo} one "
        f"at a time; {plan.nodes} KWOK nodes of {plan.shape.label} (a job's pods: {plan.pod_gpus} GPUs); "
        f"settle {args.settle:g} s; reconcile interval: {interval}; more operator env: {extra}; "
        f"KubeRay flags: {os.environ.get('RLHF_KUBERAY_ARGS', '')}"
    )


def main() -> None:
    args = parse_args()
    if args.serve_stand_in:
        serve_stand_in(args.serve_stand_in)
        return

    common.print_machine()
    try:
        plan = make_plan(args)
    except RuntimeError as e:
        common.fail(str(e))
    header(args, plan)
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    common.console.print(f"[dim]control plane in {STATE}; logs and audit extract in {WORK}[/dim]")
    try:
        if devcluster.read_state():
            devcluster.down(quiet=True)  # a leftover of an interrupted run: start clean
        devcluster.up()
        run = measure(args, plan)
    except (devcluster.ClusterError, RuntimeError, subprocess.CalledProcessError) as e:
        common.fail(f"{e}\n(operator log: {WORK / 'operator.log'})")
    finally:
        for part in (STATE / "logs").glob("audit*.log"):
            shutil.copy(part, WORK / part.name)
        if not args.keep_cluster:
            devcluster.down(quiet=True)
    report(args, plan, run)
