"""Fault injection for the reliability tests: SIGKILL one of the trainer's Ray actors the moment a named
phase of a given step starts.

`RLHF_TRAINER_FAULTS="generation@2,actor_train@3"` arms the faults; `RLHF_TRAINER_FAULTS_DIR` holds one
marker per fault fired, written before the kill, so the attempt that resumes after it does not fire it
again. Unset (every real run), `FaultInjector.from_env` gives None and nothing is checked. The kill is a real SIGKILL of a real actor
process (the tests need the actor on this host); only its timing is chosen.

`start@0` is the fast restartable failure of the operator's lifecycle tests: the driver fails at
start-up, before any model loads, in every attempt (no marker), and exits 1 like any crash, not 2 like
bad input (which the operator does not restart).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

ENV, DIR_ENV = "RLHF_TRAINER_FAULTS", "RLHF_TRAINER_FAULTS_DIR"

Victim = Callable[[str], tuple[str, int]]  # phase -> (who, pid): the actor whose death hurts it most


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


class InjectedFault(RuntimeError):
    """A failure the tests asked for (RLHF_TRAINER_FAULTS), not a bug."""


def fail_at_start() -> None:
    """Raise InjectedFault when `start@0` is armed: the driver's first act, in every attempt."""
    if ("start", 0) in armed():
        raise InjectedFault(f"{ENV}=start@0: the driver fails at start-up")


class FaultInjector:
    """Fires the armed faults. `victim(phase)` names the process to kill in every phase but `checkpoint`,
    where it is the driver itself, once every rank has written its shard and before the checkpoint is
    committed: the worst moment to lose the trainer. `checkpoint_root` is where partial checkpoints show."""

    def __init__(self, victim: Victim, checkpoint_root: Path | None) -> None:
        self.victim = victim
        self.checkpoint_root = checkpoint_root

    @classmethod
    def from_env(cls, victim: Victim, checkpoint_root: Path | None) -> FaultInjector | None:
        """None unless RLHF_TRAINER_FAULTS arms a fault (every real run)."""
        return cls(victim, checkpoint_root) if armed() else None

    def phase_started(self, step: int, phase: str) -> None:
        """Called at every phase start."""
        self.fire(step, phase, mid_write=False)

    def checkpoint_written(self, step: int) -> None:
        """Called by the checkpoint writer once the shards are written, before the commit."""
        self.fire(step, "checkpoint", mid_write=True)

    def fire(self, step: int, phase: str, mid_write: bool) -> None:
        if (phase, step) not in armed() or (phase == "checkpoint") != mid_write:
            return
        marker = Path(os.environ.get(DIR_ENV, ".")) / f"{phase}@{step}"
        if marker.exists():
            return
        who, pid = ("the driver", os.getpid()) if phase == "checkpoint" else self.victim(phase)
        root = self.checkpoint_root
        partial = sorted(p.name for p in root.glob(".tmp-*")) if root is not None else []
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(json.dumps({"who": who, "pid": pid, "partial_checkpoints": partial}) + "\n")
        print(f"fault injected: SIGKILL {who} (pid {pid}) in phase {phase} of step {step}", file=sys.stderr)
        sys.stderr.flush()
        os.kill(pid, signal.SIGKILL)
