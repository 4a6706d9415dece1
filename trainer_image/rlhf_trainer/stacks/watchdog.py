"""The driver's own hang watch: a phase running past its deadline gets a snapshot and a logged verdict,
so `rlhf run` without Kubernetes (or an operator that cannot reach the cluster) still says who is stuck.

The deadline of a phase is `factor` x the longest this phase has taken so far in the run, and never
less than `floor` seconds (the first step's phases, which load models and compile, have only the
floor). One snapshot per phase run: a phase that stays stuck is not snapshotted again. Phases may run
at once (the experience forwards, the two trainings): each is watched from its own start to its own end.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

Snapshotter = Callable[[], dict[str, Any]]


class PhaseWatchdog:
    def __init__(
        self,
        take: Snapshotter,
        report: Callable[[str, int, float, dict[str, Any]], None],
        floor: float = 300.0,
        factor: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.take, self.report, self.floor, self.factor, self.clock = take, report, floor, factor, clock
        self.longest: dict[str, float] = {}
        self._running: dict[str, tuple[int, float]] = {}  # phase -> (its step, when it started)
        self._snapped: set[str] = set()  # phases in progress already snapshotted
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def deadline(self, phase: str) -> float:
        return max(self.floor, self.factor * self.longest.get(phase, 0.0))

    def started(self, phase: str, step: int = 0) -> None:
        with self._lock:
            self._running[phase] = (step, self.clock())
            self._snapped.discard(phase)

    def ended(self, phase: str, seconds: float) -> None:
        with self._lock:
            self.longest[phase] = max(self.longest.get(phase, 0.0), seconds)
            self._running.pop(phase, None)
            self._snapped.discard(phase)

    def due(self) -> tuple[str, int, float] | None:
        """A phase past its deadline (the earliest started of those), its step and how long it has run,
        once per phase run."""
        with self._lock:
            now = self.clock()
            for phase, (step, since) in self._running.items():
                running = now - since
                if phase not in self._snapped and running > self.deadline(phase):
                    self._snapped.add(phase)
                    return phase, step, running
            return None

    def check(self) -> None:
        overdue = self.due()
        if overdue is not None:
            try:
                snap = self.take()
            except Exception as e:  # the watch must never end the run
                snap = {"processes": [], "silent_nodes": [f"the snapshot failed: {type(e).__name__}: {e}"]}
            self.report(*overdue, snap)

    def start(self, every: float = 5.0) -> PhaseWatchdog:
        def loop() -> None:
            while not self._stop.wait(every):
                self.check()

        self._thread = threading.Thread(target=loop, name="rlhf-phase-watchdog", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
