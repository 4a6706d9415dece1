"""The driver's own hang watch: a phase running past its deadline gets a snapshot and a logged verdict,
so `rlhf run` without Kubernetes (or an operator that cannot reach the cluster) still says who is stuck.

The deadline of a phase is `factor` x the longest this phase has taken so far in the run, and never
less than `floor` seconds (the first step's phases, which load models and compile, have only the
floor). One snapshot per phase run: a phase that stays stuck is not snapshotted again.
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
        self._current: tuple[str, int, float] | None = None
        self._snapped = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def deadline(self, phase: str) -> float:
        return max(self.floor, self.factor * self.longest.get(phase, 0.0))

    def started(self, phase: str, step: int = 0) -> None:
        with self._lock:
            self._current, self._snapped = (phase, step, self.clock()), False

    def ended(self, phase: str, seconds: float) -> None:
        with self._lock:
            self.longest[phase] = max(self.longest.get(phase, 0.0), seconds)
            if self._current and self._current[0] == phase:
                self._current = None

    def due(self) -> tuple[str, int, float] | None:
        """The phase past its deadline, its step and how long it has run, once per phase run."""
        with self._lock:
            if self._current is None or self._snapped:
                return None
            phase, step, since = self._current
            running = self.clock() - since
            if running <= self.deadline(phase):
                return None
            self._snapped = True
            return phase, step, running

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
