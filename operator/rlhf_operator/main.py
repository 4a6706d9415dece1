"""`rlhf operator`: runs the kopf operator, cluster-wide or over listed namespaces.

Owns process set-up only (arguments, logging, kopf.run); the behaviour lives in `handlers`.
"""

from __future__ import annotations

import argparse
import logging
import os

import kopf


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlhf operator", description="Run the RLHFJob operator (kopf).")
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument(
        "--namespace", "-n", action="append", default=[], help="watch this namespace (repeatable)"
    )
    scope.add_argument("--all-namespaces", "-A", action="store_true", help="watch every namespace (default)")
    parser.add_argument(
        "--liveness", default=None, help="kopf health endpoint, e.g. http://0.0.0.0:8080/healthz"
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=int(os.environ.get("RLHF_OPERATOR_METRICS_PORT", "8000")),
        help="port of the operator's own /metrics (0 disables)",
    )
    parser.add_argument(
        "--metrics-addr",
        default=os.environ.get("RLHF_OPERATOR_METRICS_ADDR", "127.0.0.1"),
        help="address the /metrics port binds (the chart: 0.0.0.0, every address of the pod)",
    )
    parser.add_argument(
        "--log-format", choices=["plain", "json"], default=os.environ.get("RLHF_LOG_FORMAT", "plain")
    )
    parser.add_argument("--verbose", "-v", action="store_true")
    parser.add_argument(
        "--leader-elect",
        action=argparse.BooleanOptionalAction,
        default=os.environ.get("RLHF_LEADER_ELECTION", "").lower() in ("1", "true", "yes"),
        help="act only while holding the Lease rlhf-operator-leader (several replicas; docs/chart.md)",
    )
    parser.add_argument(
        "--leader-election-namespace",
        default=os.environ.get("POD_NAMESPACE", "default"),
        help="namespace of the Lease (default: $POD_NAMESPACE, else default)",
    )
    return parser


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)

    os.environ["RLHF_OPERATOR_METRICS_PORT"] = str(args.metrics_port)
    os.environ["RLHF_OPERATOR_METRICS_ADDR"] = args.metrics_addr
    kopf.configure(
        verbose=args.verbose,
        log_format=kopf.LogFormat.JSON if args.log_format == "json" else kopf.LogFormat.PLAIN,
    )
    for noisy in ("kubernetes", "httpx", "httpcore", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    import rlhf_operator.handlers  # noqa: F401  (registers the handlers)

    elector = None
    if args.leader_elect:
        from rlhf_operator.leader import LeaderElector, standby_health

        elector = LeaderElector(args.leader_election_namespace)
        health = standby_health(args.liveness)
        elector.acquire()  # a follower waits here: no handler runs, no object is written
        if health is not None:
            health.shutdown()
            health.server_close()  # kopf's own health endpoint takes the port now
    try:
        kopf.run(
            standalone=True,
            clusterwide=not args.namespace,
            namespaces=args.namespace,
            liveness_endpoint=args.liveness,
        )
    finally:
        if elector is not None:
            elector.release()  # a clean stop hands over at once instead of after the lease expires
    return 0
