"""Fault injection for the reliability tests: SIGKILL one of the trainer's Ray actors the moment a named
phase of a given step starts.

`RLHF_TRAINER_FAULTS="generation@2,actor_train@3"` arms the faults; `RLHF_TRAINER_FAULTS_DIR` holds one
marker per fault fired, written before the kill, so the attempt that resumes after it does not fire it
again. Unset (every real run), `FaultInjector.from_env` gives None and nothing is checked. The kill is a real SIGKILL of a real actor
process (the tests need the actor on this host); only its timing is chosen.

`start@0` is the fast restartable failure of the operator's lifecycle tests: the driver fails at
start-up, before any model loads, in every attempt (no marker), and exits 1 like any crash, not 2 like
bad input (which the operator does not restart).

`engine_weight_sync@N` kills rollout engine 0 in the middle of step N's weight sync: after the driver
found every engine alive and the actor ranks began sending (WeightSyncManager.while_sending), so the
loss lands inside the broadcast, not before it (a loss before it is pruned and survived).

`engine_stop@N` SIGSTOPs rollout engine 0 as step N's actor training starts (FaultInjector.stop_engine);
`rank_hang@N` hangs an actor rank in it (fault_env.maybe_hang, in the rank's own process).

`delta_drop@N` kills nothing either: rollout engine 0 discards the first delta frame of step N's weight
sync (weightSync.delta), so its copy of that bucket is stale until the digest check finds it.

`checkpoint_hold@N` kills nothing: it holds step N's save where `checkpoint@N` would kill (every shard
written, nothing committed) until the test creates `<marker>.release`, so the test can act at that moment
for sure (the preemption test's second SIGTERM mid-save). The wait is bounded (HOLD_ENV, 60 s): past it,
InjectedFault names the file it waited for, and the save is aborted like any failed one.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

from rlhf_trainer.fault_env import DIR_ENV, ENV, START_FAILURE, InjectedFault, armed, write_marker
from rlhf_trainer.fault_env import marker as _marker

__all__ = ["DIR_ENV", "ENV", "FaultInjector", "InjectedFault", "armed", "fail_at_start"]

HOLD, HOLD_ENV, HOLD_SECONDS = "checkpoint_hold", "RLHF_TRAINER_FAULTS_HOLD_SECONDS", 60.0
ENGINE_MID_SYNC = "engine_weight_sync"
ENGINE_STOP = "engine_stop"
DELTA_DROP = "delta_drop"

Victim = Callable[[str], tuple[str, int]]  # phase -> (who, pid): the actor whose death hurts it most


def fail_at_start() -> None:
    """Raise InjectedFault when `start@0` is armed: the driver's first act, in every attempt."""
    if ("start", 0) in armed():
        raise InjectedFault(START_FAILURE)


class FaultInjector:
    """Fires the armed faults. `victim(phase)` names the process to kill in every phase but `checkpoint`,
    where it is the driver itself, once every rank has written its shard and before the checkpoint is
    committed: the worst moment to lose the trainer. `checkpoint_root` is where partial checkpoints show."""

    def __init__(self, victim: Victim, checkpoint_root: Path | None) -> None:
        self.victim = victim
        self.checkpoint_root = checkpoint_root
        self.step = 0  # the step whose phase started last

    @classmethod
    def from_env(cls, victim: Victim, checkpoint_root: Path | None) -> FaultInjector | None:
        """None unless RLHF_TRAINER_FAULTS arms a fault (every real run)."""
        return cls(victim, checkpoint_root) if armed() else None

    def phase_started(self, step: int, phase: str) -> None:
        """Called at every phase start."""
        self.step = step
        self.fire(step, phase, mid_write=False)
        if phase == "actor_train":
            self.stop_engine(step)

    def stop_engine(self, step: int) -> None:
        """`engine_stop@N`: SIGSTOP rollout engine 0 as step N's actor training starts, so a stack
        snapshot meets a process that cannot answer (the diagnosis tests). Once, like the kills; the
        stopped process dies with the attempt (a SIGKILL needs no cooperation)."""
        if (ENGINE_STOP, step) not in armed() or _marker(ENGINE_STOP, step).exists():
            return
        who, pid = self.victim("generation")
        self._kill(_marker(ENGINE_STOP, step), who, pid, f"in step {step}", signal.SIGSTOP)

    def weights_sending(self) -> None:
        """Called once the actor ranks have begun sending a weight sync's buckets: `engine_weight_sync`."""
        step, phase = self.step, ENGINE_MID_SYNC
        if (phase, step) not in armed() or _marker(phase, step).exists():
            return
        who, pid = self.victim("generation")  # rollout engine 0
        self._kill(_marker(phase, step), who, pid, f"mid weight sync of step {step}")

    def delta_dropped(self) -> bool:
        """`delta_drop@N`: rollout engine 0 discards the first delta frame of step N's weight sync, as a
        lost one would be (it kills nothing: the digest check must find the engine's stale copy). True
        once, when the driver should ask for it."""
        step = self.step
        if (DELTA_DROP, step) not in armed() or _marker(DELTA_DROP, step).exists():
            return False
        self._mark(_marker(DELTA_DROP, step), "rollout engine 0", 0)
        print(
            f"fault injected: rollout engine 0 drops a delta frame of step {step}'s weight sync",
            file=sys.stderr,
        )
        sys.stderr.flush()
        return True

    def checkpoint_written(self, step: int) -> None:
        """Called by the checkpoint writer once the shards are written, before the commit."""
        self.hold(step)
        self.fire(step, "checkpoint", mid_write=True)

    def fire(self, step: int, phase: str, mid_write: bool) -> None:
        if (phase, step) not in armed() or (phase == "checkpoint") != mid_write:
            return
        marker = _marker(phase, step)
        if marker.exists():
            return
        who, pid = ("the driver", os.getpid()) if phase == "checkpoint" else self.victim(phase)
        self._kill(marker, who, pid, f"in phase {phase} of step {step}")

    def _kill(
        self, marker: Path, who: str, pid: int, when: str, sig: signal.Signals = signal.SIGKILL
    ) -> None:
        """Mark the fault fired (before it fires: the victim may be this process), say so, send `sig`."""
        self._mark(marker, who, pid)
        print(f"fault injected: {sig.name} {who} (pid {pid}) {when}", file=sys.stderr)
        sys.stderr.flush()
        os.kill(pid, sig)

    def hold(self, step: int) -> None:
        """`checkpoint_hold@step`: write the marker, then wait until `<marker>.release` exists (at most
        HOLD_ENV seconds, else InjectedFault). Once per marker, like the kills."""
        if (HOLD, step) not in armed():
            return
        marker = _marker(HOLD, step)
        if marker.exists():
            return
        limit = float(os.environ.get(HOLD_ENV) or HOLD_SECONDS)
        release = marker.with_name(marker.name + ".release")
        self._mark(marker, "the driver", os.getpid())
        print(
            f"fault injected: step {step}'s checkpoint held before its commit until {release} exists "
            f"(at most {limit:g} s)",
            file=sys.stderr,
        )
        sys.stderr.flush()
        deadline = time.monotonic() + limit
        while not release.exists():
            if time.monotonic() >= deadline:
                raise InjectedFault(
                    f"{ENV}={HOLD}@{step}: {release} did not appear within {limit:g} s ({HOLD_ENV}); "
                    f"step {step}'s checkpoint is not committed"
                )
            time.sleep(0.01)

    def _mark(self, marker: Path, who: str, pid: int) -> None:
        """The marker the test reads: who fires, and the partial checkpoints at that moment."""
        root = self.checkpoint_root
        partial = sorted(p.name for p in root.glob(".tmp-*")) if root is not None else []
        write_marker(marker, {"who": who, "pid": pid, "partial_checkpoints": partial})
