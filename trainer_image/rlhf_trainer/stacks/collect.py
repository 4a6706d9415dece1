"""Take a snapshot: signal every registered process of a node and read its dump, each within a limit.

`collect_node` is what runs on a node (a Ray task pinned to it, or the caller's own host); `snapshot`
runs it on every live node of the Ray cluster at once and puts the answers together. A process that
has not written a complete dump by the limit is reported as not answering, with its kernel state
(`T (stopped)`, `D (disk sleep)`), so a snapshot never waits on the process it is meant to diagnose.
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rlhf_api.constants import STACK_PROCESS_LIMIT_SECONDS

from rlhf_trainer.stacks import nccl
from rlhf_trainer.stacks.dump import SIGNAL, Registration, job_key, parse, registry, start_ticks

PROCESS_LIMIT_SECONDS = float(STACK_PROCESS_LIMIT_SECONDS)
_SETTLED = 0.2  # a dump is complete once its size has not changed for this long


def registered(root: Path, node_id: str | None, job: str = "") -> list[Registration]:
    """The live processes registered in `root` (on `node_id`, when given; of RLHFJob `job` when both it
    and the registration name one: jobs sharing a Ray head); the dead ones' files go."""
    found = []
    for path in sorted(root.glob("*.json")):
        try:
            reg = Registration.from_json(path.read_text())
        except (OSError, ValueError, TypeError):
            continue
        if start_ticks(reg.pid) != reg.start_ticks:  # gone, or its pid reused
            for stale in (path, root / f"{reg.pid}.stack"):
                stale.unlink(missing_ok=True)
            continue
        if node_id and reg.node_id and reg.node_id != node_id:
            continue
        if job and reg.job and reg.job != job:
            continue
        if reg.pid != os.getpid():
            found.append(reg)
    return found


def process_state(pid: int) -> str:
    """The kernel's word for the process (`S (sleeping)`, `T (stopped)`), or `gone`."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("State:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "gone"


def collect_node(
    node_id: str | None = None, limit: float = PROCESS_LIMIT_SECONDS, job: str | None = None
) -> list[dict[str, Any]]:
    """Every registered process of this node: its registration, whether it answered within `limit`
    seconds, its threads (innermost frame first) and how long it took. One snapshot at a time per
    node (a lock file); signalled all at once, so the node takes at most `limit`, not a sum."""
    root = registry()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        regs = registered(root, node_id, job_key() if job is None else job)
        asked: dict[int, float] = {}
        for reg in regs:
            try:
                os.truncate(root / f"{reg.pid}.stack", 0)
                os.kill(reg.pid, SIGNAL)
                asked[reg.pid] = time.monotonic()
            except OSError:
                pass
        sizes: dict[int, tuple[int, float]] = {}
        done: dict[int, float] = {}
        deadline = time.monotonic() + limit
        while len(done) < len(asked) and time.monotonic() < deadline:
            now = time.monotonic()
            for pid in asked.keys() - done.keys():
                size = _size(root / f"{pid}.stack")
                before = sizes.get(pid)
                if before is None or before[0] != size:
                    sizes[pid] = (size, now)
                elif size > 0 and now - before[1] >= _SETTLED:
                    done[pid] = before[1] - asked[pid]
            time.sleep(0.05)
        out = []
        for reg in regs:
            entry: dict[str, Any] = asdict(reg)
            if reg.pid in done:
                text = (root / f"{reg.pid}.stack").read_text(errors="replace")
                entry.update(answered=True, seconds=round(done[reg.pid], 3))
                entry["threads"] = [asdict(t) for t in parse(text)]
            else:
                entry.update(answered=False, state=process_state(reg.pid), limit_seconds=limit)
            out.append(entry)
        return out


def flight_records(root: Path | None = None) -> list[dict[str, Any]]:
    """torch's NCCL flight-recorder dumps on this node (written on a collective timeout; stacks.nccl)."""
    root = root or nccl.debug_dir()
    pod = os.environ.get("HOSTNAME") or socket.gethostname()
    found = sorted(root.glob("trace_*")) if root.is_dir() else []
    return [{"pod": pod, "file": str(p), "bytes": _size(p)} for p in found]


def node_snapshot(node_id: str | None, limit: float, job: str) -> dict[str, Any]:
    """What one node's collector returns: its processes' stacks and its flight-recorder dumps."""
    return {"processes": collect_node(node_id, limit, job), "nccl_traces": flight_records()}


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def snapshot(limit: float = PROCESS_LIMIT_SECONDS, node_timeout: float = 60.0) -> dict[str, Any]:
    """The snapshot of every process of the Ray cluster this process is connected to: one collector
    task per live node (no CPU asked, so a full node still runs it), answers within `node_timeout`."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    started = time.monotonic()
    taken_at = datetime.now(UTC).isoformat(timespec="seconds")
    nodes = [n for n in ray.nodes() if n.get("Alive")]  # type: ignore[no-untyped-call]
    task = ray.remote(num_cpus=0, max_retries=0)(node_snapshot)
    refs = {
        task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote(
            n["NodeID"], limit, job_key()
        ): n
        for n in nodes
    }
    ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=node_timeout)
    processes: list[dict[str, Any]] = []
    traces: list[dict[str, Any]] = []
    silent_nodes = []
    for ref, node in refs.items():
        name = node.get("NodeManagerHostname") or node["NodeID"][:12]
        if ref not in ready:
            silent_nodes.append(f"{name}: its collector did not return within {node_timeout:g} s")
            continue
        try:
            answer = ray.get(ref)
            processes.extend(answer["processes"])
            traces.extend(t for t in answer["nccl_traces"] if t not in traces)
        except Exception as e:  # a node that died meanwhile
            silent_nodes.append(f"{name}: {type(e).__name__}: {e}")
    seen: set[tuple[str, int]] = set()  # nodes of a local Ray share one host and one registry
    unique = []
    for p in processes:
        if (p["pod"], p["pid"]) not in seen:
            seen.add((p["pod"], p["pid"]))
            unique.append(p)
    return {
        "taken_at": taken_at,
        "seconds": round(time.monotonic() - started, 3),
        "limit_seconds": limit,
        "processes": unique,
        "silent_nodes": silent_nodes,
        "nccl_traces": traces,
    }
