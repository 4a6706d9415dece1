"""`python -m rlhf_trainer.drain`: the rollout container's preStop hook, which tells Ray its node is going.

On a scale-down (or an eviction) KubeRay deletes a rollout pod of its choosing, and the container's Ray
processes ignore the kubelet's SIGTERM (KubeRay's `bash -c`), so the trainer learnt of the loss only when
the grace period ended and the engine vanished, at any moment of a step: during the weight sync that
fails the attempt (docs/reliability.md). This hook drains the pod's Ray node instead (Ray's DrainNode,
reason preemption, deadline the grace period): Ray places nothing new there, and the trainer retires
the engine on it at its next step boundary or before its next weight sync (rollout/pool.py), long before
the kill. It exits 0 whatever happened: a failed hook only makes an Event, and it must never hang.
"""

from __future__ import annotations

import argparse
import importlib
import time
from typing import Any

from rlhf_trainer import container_log

REASON = "DRAIN_NODE_REASON_PREEMPTION"  # accepted with actors running, unlike idle termination
GCS_TIMEOUT_SECONDS = 10


def local_node(nodes: dict[str, tuple[str, bool]], ip: str) -> str | None:
    """The hex id of the one alive Ray node at `ip` ({hex id: (node manager address, alive)}); None when
    there is none or more than one (only a pod has one Ray node per address)."""
    found = [node for node, (address, alive) in nodes.items() if alive and address == ip]
    return found[0] if len(found) == 1 else None


def _gcs(address: str | None, temp_dir: str | None) -> tuple[Any, str]:
    from ray._private import services
    from ray._raylet import GcsClient  # type: ignore[attr-defined]

    resolved = services.canonicalize_bootstrap_address(address or "auto", temp_dir)
    if resolved is None:
        raise RuntimeError("no Ray cluster on this node (no RAY_ADDRESS, no ray_current_cluster)")
    return GcsClient(address=resolved), resolved


def drain(
    address: str | None, node_id: str | None, deadline_seconds: int, message: str, temp_dir: str | None = None
) -> str:
    """Drain this node (or `node_id`); returns the drained node's hex id. Raises when Ray refuses."""
    from ray._private import services

    # Ray's generated protobuf modules (mypy sees no classes in generated code)
    autoscaler_pb2: Any = importlib.import_module("ray.core.generated.autoscaler_pb2")
    gcs_pb2: Any = importlib.import_module("ray.core.generated.gcs_pb2")
    gcs, resolved = _gcs(address, temp_dir)
    if node_id is None:
        alive = gcs_pb2.GcsNodeInfo.GcsNodeState.Value("ALIVE")
        infos = gcs.get_all_node_info(timeout=GCS_TIMEOUT_SECONDS)
        nodes = {k.hex(): (str(v.node_manager_address), v.state == alive) for k, v in infos.items()}
        node_id = local_node(nodes, services.get_node_ip_address(resolved))  # type: ignore[no-untyped-call]
        if node_id is None:
            raise RuntimeError(f"no single alive Ray node at this pod's address among {len(nodes)} node(s)")
    deadline_ms = time.time_ns() // 1_000_000 + deadline_seconds * 1000
    accepted, why = gcs.drain_node(
        node_id, autoscaler_pb2.DrainNodeReason.Value(REASON), message, deadline_ms
    )
    if not accepted:
        raise RuntimeError(f"Ray refused to drain node {node_id}: {why}")
    return str(node_id)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rlhf_trainer.drain", description=__doc__)
    p.add_argument("--deadline-seconds", type=int, default=30, help="when the node goes (the grace period)")
    p.add_argument("--address", help="the GCS (default: this node's cluster)")
    p.add_argument("--node-id", help="the node to drain (default: this pod's)")
    p.add_argument("--temp-dir", help="Ray's temp dir, to find this node's cluster (default: Ray's)")
    args = p.parse_args(argv)
    t0 = time.monotonic()
    try:
        node = drain(args.address, args.node_id, args.deadline_seconds, "rollout pod deleted", args.temp_dir)
        _say(
            f"drain: Ray node {node} draining, {args.deadline_seconds} s to go ({time.monotonic() - t0:.1f} s)"
        )
    except Exception as e:  # the engine is then lost at the kill, as without the hook
        _say(f"drain: error: {type(e).__name__}: {e}")
    return 0


def _say(line: str) -> None:
    print(line, flush=True)
    container_log.echo(line, roles=("rollout",))


if __name__ == "__main__":
    raise SystemExit(main())
