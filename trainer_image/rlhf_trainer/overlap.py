"""Phases of a step that run at the same time because different groups of Ray actors host them: the
experience forwards (reference, critic values, old log-probs) and the two trainings (actor, critic).

Owns when each phase's calls are launched and when it counts as done: every group's first phase is
launched at once, a phase ends when its own refs are done (its seconds: launch to that moment), and a
group's next phase is launched only then. Must not decide what a phase computes (loop.py) nor where a
role runs (placement.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import ray

from rlhf_trainer.metrics import PhaseTimer

# The overlap benchmark's baseline (benchmarks/overlap.py): "1" runs these phases one at a time, in the
# order given, as the trainer did before they overlapped. An environment variable, not a spec field.
SEQUENTIAL_ENV = "RLHF_SEQUENTIAL_PHASES"


@dataclass(frozen=True)
class PhaseWork:
    """One phase's work: `launch` issues its calls on `group` and returns their refs without waiting."""

    phase: str
    group: object  # the group hosting it (by identity): its phases run one after the other, in order
    launch: Callable[[], list[Any]]


def sequential() -> bool:
    """Whether RLHF_SEQUENTIAL_PHASES=1 asks for one phase at a time (the benchmark's baseline)."""
    return os.environ.get(SEQUENTIAL_ENV, "") == "1"


def lanes(works: Sequence[PhaseWork], one_at_a_time: bool) -> list[list[PhaseWork]]:
    """The works split into lanes that run side by side, each lane in order: one lane per group, or a
    single lane of everything when one at a time. Two phases of one group never run at once: its
    processes would serialise them anyway, and timing the second from a shared launch would charge it
    the first one's seconds."""
    by_group: dict[int, list[PhaseWork]] = {}
    for w in works:
        by_group.setdefault(0 if one_at_a_time else id(w.group), []).append(w)
    return list(by_group.values())


def run_phases(timer: PhaseTimer, works: Sequence[PhaseWork]) -> dict[str, list[Any]]:
    """Run `works`, every lane's first phase launched before anything is waited on (one lane of all of
    them under RLHF_SEQUENTIAL_PHASES=1); returns {phase: its refs}, all done. A phase is in progress
    (`timer`) from its launch to the end of its own refs. A failed call raises from `ray.get` while its
    own phase is in progress (errors surface in the phase that caused them), and every phase still
    running is stopped too, so no gauge is left at 1."""
    queues = lanes(works, sequential())
    running: dict[str, tuple[float, list[Any], int]] = {}  # phase -> (its start, its refs, its lane)
    done: dict[str, list[Any]] = {}
    ready: set[Any] = set()

    def launch_next(lane: int) -> None:
        if queues[lane]:
            w = queues[lane].pop(0)
            t0 = timer.start(w.phase)  # in progress (and its fault fires) before its calls go out
            running[w.phase] = (t0, [], lane)  # stopped by `finally` should launching fail
            running[w.phase] = (t0, list(w.launch()), lane)

    try:
        for lane in range(len(queues)):
            launch_next(lane)
        while running:
            finished = [p for p, (_, refs, _) in running.items() if all(r in ready for r in refs)]
            if not finished:
                pending = [r for _, refs, _ in running.values() for r in refs if r not in ready]
                got, _ = ray.wait(pending, num_returns=1)
                ready.update(got)
                continue
            for phase in finished:
                t0, refs, lane = running[phase]
                ray.get(refs)  # surface errors inside the phase that caused them
                del running[phase]
                timer.stop(phase, t0)
                done[phase] = refs
                launch_next(lane)
    finally:
        for phase, (t0, _, _) in list(running.items()):  # an error: nothing is left marked in progress
            timer.stop(phase, t0)
    return done
