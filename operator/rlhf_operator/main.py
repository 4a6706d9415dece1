"""`rlhf operator`: runs the kopf operator, cluster-wide or over listed namespaces.

Owns process set-up only (arguments, logging, kopf.run); the behaviour lives in `handlers`.
"""

from __future__ import annotations

import argparse
import logging
import os

import kopf


def main(argv: list[str]) -> int:
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
        "--log-format", choices=["plain", "json"], default=os.environ.get("RLHF_LOG_FORMAT", "plain")
    )
    parser.add_argument("--verbose", "-v", action="store_true")
    args = parser.parse_args(argv)

    os.environ["RLHF_OPERATOR_METRICS_PORT"] = str(args.metrics_port)
    kopf.configure(
        verbose=args.verbose,
        log_format=kopf.LogFormat.JSON if args.log_format == "json" else kopf.LogFormat.PLAIN,
    )
    for noisy in ("kubernetes", "httpx", "httpcore", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    import rlhf_operator.handlers  # noqa: F401  (registers the handlers)

    kopf.run(
        standalone=True,
        clusterwide=not args.namespace,
        namespaces=args.namespace,
        liveness_endpoint=args.liveness,
    )
    return 0
