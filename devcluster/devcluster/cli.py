"""The local control plane: real etcd, kube-apiserver, controller-manager, scheduler, KWOK and KubeRay.

Builds each component from the Go module proxy (cached under the user's cache directory), starts them
as background processes on loopback, and tears them down. Standard library only, so it runs before
the project's virtualenv exists. It never downloads a release binary.

    python3 devcluster/devcluster.py build|up|down|status|env|restart|kueue-up|kueue-down

kueue-up starts Kueue (issue 16) in a running control plane; kueue-down stops it and removes its webhooks.

This module is that command line (its docstring is `--help`'s description); the work is the package's.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Iterator

from devcluster.binaries import binary_names
from devcluster.config import STATE, ClusterError
from devcluster.controlplane import down, restart, status, up
from devcluster.gobuild import build, plan
from devcluster.kueue import kueue_down, kueue_up


@contextlib.contextmanager
def _timed(label: str) -> Iterator[None]:
    t0 = time.monotonic()
    yield
    print(f"[{label}] {time.monotonic() - t0:.1f}s", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "command", choices=["build", "up", "down", "status", "env", "restart", "kueue-up", "kueue-down"]
    )
    parser.add_argument(
        "names",
        nargs="*",
        help="build: binaries or groups to build (up, test; default all); restart: the component",
    )
    parser.add_argument(
        "--plan", action="store_true", help="build: only say what would be compiled and its cold estimate"
    )
    args = parser.parse_intermixed_args(argv)
    try:
        if args.command == "build" and args.plan:
            todo = plan(binary_names(args.names))
            parts = (
                ", ".join(f"{name} ~{seconds}s" for name, seconds in todo.items()) or "nothing: all cached"
            )
            print(f"[build] plan: {parts}")
            print(f"build-plan-seconds: {sum(todo.values())}")
        elif args.command == "build":
            with _timed("build"):
                build(names=binary_names(args.names))
        elif args.command == "up":
            up()
        elif args.command == "down":
            down()
        elif args.command == "kueue-up":
            kueue_up(build_binary=True)
        elif args.command == "kueue-down":
            kueue_down()
        elif args.command == "status":
            return status()
        elif args.command == "restart":
            component = args.names[0] if args.names else ""
            print(f"{component} healthy again after {restart(component):.1f}s")
        elif args.command == "env":
            print(f"export KUBECONFIG={STATE / 'kubeconfig'}\nexport PATH={STATE / 'bin'}:$PATH")
    except ClusterError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
