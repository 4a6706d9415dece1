"""Fault injection for the reliability tests: SIGKILL one of the trainer's Ray actors the moment a named
phase of a given step starts.

`RLHF_TRAINER_FAULTS="generation@2,actor_train@3"` arms the faults; `RLHF_TRAINER_FAULTS_DIR` holds one
marker per fault fired, written before the kill, so the attempt that resumes after it does not fire it
again. Unset (every real run), `maybe_fire` returns at once. The kill is a real SIGKILL of a real actor
process (the tests need the actor on this host); only its timing is chosen.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlhf_trainer.driver import Trainer

ENV, DIR_ENV = "RLHF_TRAINER_FAULTS", "RLHF_TRAINER_FAULTS_DIR"


def armed(raw: str | None = None) -> list[tuple[str, int]]:
    """`phase@step,...` as [(phase, step)]; a malformed entry is an error, not silently no fault."""
    raw = os.environ.get(ENV, "") if raw is None else raw
    out = []
    for item in filter(None, (x.strip() for x in raw.split(","))):
        phase, sep, step = item.partition("@")
        if not sep or not step.isdigit():
            raise ValueError(f"{ENV}: {item!r} is not phase@step")
        out.append((phase, int(step)))
    return out


def victim(t: Trainer, phase: str) -> tuple[str, Any]:
    """The actor whose death hurts this phase: the engine generating, the reward worker scoring, the
    last critic rank in the critic's phases, otherwise the last actor rank (training, weight sync).
    In `checkpoint` it is the driver itself, once every rank has written its shard and before the
    checkpoint is committed: the worst moment to lose the trainer."""
    if phase == "checkpoint":
        return "the driver", os.getpid()
    if phase == "generation":
        return "rollout engine 0", t.pool.ready()[0].handle
    if phase == "reward" and hasattr(t.reward, "_actor_id"):
        return "reward worker", t.reward
    if phase in ("critic_values", "critic_train") and t.critic_group is not None:
        return f"critic rank {t.critic_group.world_size - 1}", t.critic_group.handles[-1]
    return f"actor rank {t.actor_group.world_size - 1}", t.actor_group.handles[-1]


def maybe_fire(t: Trainer, step: int, phase: str, mid_write: bool = False) -> None:
    """Called at every phase start, and from the checkpoint writer with mid_write=True."""
    if (phase, step) not in armed() or (phase == "checkpoint") != mid_write:
        return
    marker = Path(os.environ.get(DIR_ENV, ".")) / f"{phase}@{step}"
    if marker.exists():
        return
    who, target = victim(t, phase)
    if isinstance(target, int):
        pid = target
    else:
        from ray.util.state import get_actor

        state = get_actor(target._actor_id.hex())
        if state is None or not state.pid:
            raise RuntimeError(f"fault {phase}@{step}: cannot find the pid of {who}")
        pid = int(state.pid)
    partial = sorted(p.name for p in t.store.root.glob(".tmp-*")) if t.store is not None else []
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(json.dumps({"who": who, "pid": pid, "partial_checkpoints": partial}) + "\n")
    print(f"fault injected: SIGKILL {who} (pid {pid}) in phase {phase} of step {step}", file=sys.stderr)
    sys.stderr.flush()
    os.kill(pid, signal.SIGKILL)
