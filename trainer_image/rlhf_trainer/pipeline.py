"""Asynchronous RL's bookkeeping: a rollout generated in the background, its weight version, the
staleness rule, and the idle ratios of both sides.

Owns the pure decisions (is a batch too stale, and what then; how idle was each side in a step) and the
one thread that drains a batch's streams while the actor trains. The order of a step is loop.py's.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, Literal, TypeVar

T = TypeVar("T")
StaleAction = Literal["train", "Regenerate", "Drop"]


def staleness(trained_version: int, generated_version: int) -> int:
    """Optimizer steps between the weights that generated a batch and the policy about to train on it."""
    return max(trained_version - generated_version, 0)


def admit(stale: int, max_staleness: int, policy: str) -> StaleAction:
    """`train` a batch within the bound; otherwise the spec's `staleSamples` choice (Regenerate or Drop)."""
    if stale <= max_staleness:
        return "train"
    if policy not in ("Regenerate", "Drop"):
        raise ValueError(f"unknown staleSamples {policy!r} (Regenerate or Drop)")
    return "Regenerate" if policy == "Regenerate" else "Drop"


def busy_seconds(intervals: Sequence[tuple[float, float]], start: float, end: float) -> float:
    """Seconds of [start, end] covered by the (possibly overlapping) busy intervals."""
    covered, cursor = 0.0, start
    for a, b in sorted(intervals):
        a, b = max(a, cursor), min(b, end)
        if b > a:
            covered += b - a
            cursor = b
    return covered


def idle_ratio(busy: float, step_seconds: float) -> float:
    """1 - busy / step, within [0, 1] (0 for an empty step)."""
    if step_seconds <= 0:
        return 0.0
    return min(max(1.0 - busy / step_seconds, 0.0), 1.0)


@dataclass
class Background(Generic[T]):
    """`work()` run on a daemon thread from creation; `result()` waits for it and re-raises its error.

    A batch generated ahead needs the driver's attention while the actor trains (reading the engines'
    streams, handing finished chunks to the scorer): Ray's driver API is thread-safe, so one thread does
    it. `cancel()` marks an abandoned batch (a stop, the end of the run): what it logs after is dropped."""

    work: Callable[[], T]
    name: str = "rollout"
    started: float = field(default_factory=time.monotonic)
    finished: float | None = None
    cancelled: bool = False
    _value: T | None = None
    _error: BaseException | None = None
    _thread: threading.Thread | None = None

    def __post_init__(self) -> None:
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._value = self.work()
        except BaseException as e:  # handed to whoever calls result()
            self._error = e
        finally:
            self.finished = time.monotonic()

    def done(self) -> bool:
        return self.finished is not None

    def result(self, timeout: float | None = None) -> T:
        assert self._thread is not None
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"{self.name} did not finish within {timeout} s")
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]

    def cancel(self) -> None:
        self.cancelled = True

    def interval(self, now: float | None = None) -> tuple[float, float]:
        """When it ran: (started, finished), or (started, now) while it runs."""
        return self.started, self.finished if self.finished is not None else (now or time.monotonic())
