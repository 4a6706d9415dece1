"""Stopping when told to (SIGTERM: Kueue preemption, suspension, a drained node): the signal and the decision.

Owns `StopRequest`, whose handler only records when the signal came (no I/O, no exception: a second
SIGTERM cannot abort a checkpoint save in progress), the stop budget, and `decide_stop`, the pure choice
at a step boundary between saving a checkpoint of the step just completed and keeping the last one. The
driver acts on the decision; this module never touches Ray, checkpoints or the clock's side effects.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType
from typing import Any

from rlhf_api.constants import SHUTDOWN_MARGIN_SECONDS, STOP_BUDGET_ENV

# The save time assumed when neither this run nor the checkpoint it resumed from measured one (a run that
# has not saved yet): 60 s, more than the default budget (30 s grace less the 10 s margin), so such a run
# keeps what it has instead of being killed mid-save. A measured save replaces it from the first one on.
UNMEASURED_SAVE_SECONDS = 60.0


class StopDuringStartUp(KeyboardInterrupt):
    """Raised in the main thread by a SIGTERM that comes inside `StopRequest.interruptible()`: the run is
    still starting (ranks, engines, model loads) and has trained nothing, so there is nothing to save and
    no reason to finish starting. A KeyboardInterrupt because Ray's blocking calls (`ray.get`) pass only
    that on from a signal handler (as a plain KeyboardInterrupt: catch that and read `requested`); any
    other exception raised there is lost until the call returns."""


class StopRequest:
    """Set by SIGTERM; read at every step boundary. `at` is the first signal's time.monotonic() (None:
    no stop requested), `signals` how many came. The handler stays installed: a second SIGTERM counts
    and does nothing else, so it cannot cut a save short (SIGKILL at the budget's end is the backstop).
    Only inside `interruptible()` (the start-up, where nothing is written) does it raise."""

    def __init__(self) -> None:
        self.at: float | None = None
        self.signals = 0
        self._previous: Any = None
        self._installed = False
        self._interrupt = False

    def install(self) -> StopRequest:
        """(Re)install the SIGTERM handler (main thread only); again after `ray.init`, which installs its
        own. `restore` puts back the handler found at the first install."""
        previous = signal.signal(signal.SIGTERM, self._handle)
        if not self._installed:
            self._previous, self._installed = previous, True
        return self

    def restore(self) -> None:
        if self._installed:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if self._previous is None else self._previous)
            self._installed = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.at is None:
            self.at = time.monotonic()
        self.signals += 1
        if self._interrupt:
            self._interrupt = False  # once: the clean-up after it is not interrupted again
            raise StopDuringStartUp

    @contextmanager
    def interruptible(self) -> Iterator[None]:
        """A block that a SIGTERM ends at once (StopDuringStartUp; Ray's calls raise it as a plain
        KeyboardInterrupt), for start-up work that writes nothing; one already requested ends it on
        entry. Outside it a SIGTERM is only recorded, for the next step boundary."""
        if self.requested:
            raise StopDuringStartUp
        self._interrupt = True
        try:
            yield
        finally:
            self._interrupt = False

    @property
    def requested(self) -> bool:
        return self.at is not None

    def elapsed(self, now: float | None = None) -> float:
        """Seconds since the first signal (0 if none came)."""
        if self.at is None:
            return 0.0
        return (time.monotonic() if now is None else now) - self.at


def stop_budget(env: Mapping[str, str], grace_seconds: int) -> float:
    """Seconds the trainer has from the signal to its exit: STOP_BUDGET_ENV (the operator sets it to
    the pods' grace less SHUTDOWN_MARGIN_SECONDS), else the spec's grace less that margin; never < 0.
    A malformed value falls back to the spec's (the run must not fail over it)."""
    raw = env.get(STOP_BUDGET_ENV, "").strip()
    try:
        value = float(raw) if raw else float(grace_seconds - SHUTDOWN_MARGIN_SECONDS)
    except ValueError:
        value = float(grace_seconds - SHUTDOWN_MARGIN_SECONDS)
    return max(0.0, value)


def estimate_save_seconds(measured: float | None, recorded: float | None) -> float:
    """The last save of this run, else the one recorded in the checkpoint it resumed from (same job,
    model and storage), else UNMEASURED_SAVE_SECONDS."""
    for seconds in (measured, recorded):
        if seconds is not None and seconds >= 0:
            return seconds
    return UNMEASURED_SAVE_SECONDS


@dataclass(frozen=True)
class StopDecision:
    save: bool
    reason: str  # one clause for the log: why it saves or keeps


def decide_stop(
    *,
    on_preemption: str,
    has_path: bool,
    completed: int,
    last_checkpoint: int,
    save_seconds: float,
    elapsed: float,
    budget: float,
) -> StopDecision:
    """Save the step just `completed` (its checkpoint being `last_checkpoint`: 0 for none) or keep the
    last one. Saves only under onPreemption Save, with a checkpoint path, when the step is newer than the
    last checkpoint, and when the estimated `save_seconds` fit in what is left of `budget` (`elapsed`:
    seconds since the signal)."""
    left = budget - elapsed
    if not has_path:
        return StopDecision(False, "checkpoint.path is not set")
    if completed <= last_checkpoint:
        return StopDecision(False, f"step {completed} is already checkpointed")
    if on_preemption != "Save":
        return StopDecision(False, f"checkpoint.onPreemption is {on_preemption}")
    if save_seconds > left:
        return StopDecision(
            False,
            f"a save takes ~{save_seconds:.1f} s and {max(left, 0.0):.1f} s of the {budget:.0f} s budget are left",
        )
    return StopDecision(
        True, f"a save takes ~{save_seconds:.1f} s and {left:.1f} s of the {budget:.0f} s budget are left"
    )


def saved_line(step: int) -> str:
    return f"preempted: saved checkpoint at step {step} (lost 0 steps)"


def kept_line(kept: int, completed: int) -> str:
    """`kept`: the newest checkpoint's step (0: none)."""
    if kept == 0:
        return f"preempted: no checkpoint to keep ({completed} steps to redo)"
    return f"preempted: kept checkpoint at step {kept} ({completed - kept} steps to redo)"
