"""Per-request scheduling: work items started one at a time on the least-loaded engine.

Owns which engine runs each item and how many run at once on each (`per_engine`). An engine is chosen when
an item starts, by requests in flight, not in static chunks: a long episode holds only its own slot, and
the next item goes wherever a slot frees first. Must not know what an item does (an agent episode today; a
partial rollout resumed later): it hands the chosen engine's client to `work` and keeps the result. No Ray:
engines are `EngineClient`s, so tests drive it with doubles of controlled latency.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from rlhf_trainer.agents.contract import EngineClient

Item = TypeVar("Item")
Result = TypeVar("Result")


@dataclass
class DispatchRecord:
    """Where items went: the engine of each item (by index), and each engine's peak concurrency."""

    engine_of: list[int] = field(default_factory=list)
    peak_in_flight: list[int] = field(default_factory=list)

    def items_per_engine(self) -> list[int]:
        return [self.engine_of.count(e) for e in range(len(self.peak_in_flight))]


class EpisodeDispatcher(Generic[Item, Result]):
    """Runs items over `engines`, at most `per_engine` at once on each, each started on the engine with the
    fewest in flight (ties: the lowest index), in the order given. A failing item fails the whole run (its
    siblings are cancelled): an engine loss is the step's to handle; failures an item can survive (a tool)
    are the item's to turn into a result."""

    def __init__(self, engines: Sequence[EngineClient], per_engine: int) -> None:
        if not engines:
            raise ValueError("agent dispatch: no engine")
        if per_engine < 1:
            raise ValueError(f"agent dispatch: per-engine concurrency {per_engine} must be positive")
        self.engines = list(engines)
        self.per_engine = per_engine
        self.in_flight = [0] * len(self.engines)
        self.record = DispatchRecord([], [0] * len(self.engines))

    def least_loaded(self) -> int | None:
        """The engine the next item starts on, or None when every engine is at its limit."""
        e = min(range(len(self.engines)), key=lambda k: (self.in_flight[k], k))
        return e if self.in_flight[e] < self.per_engine else None

    async def run(
        self, items: Sequence[Item], work: Callable[[EngineClient, Item], Awaitable[Result]]
    ) -> list[Result]:
        """`work(engine, item)` for every item; the results in item order."""
        results: dict[int, Result] = {}
        freed = asyncio.Condition()
        self.record.engine_of = [-1] * len(items)

        async def one(i: int, e: int, item: Item) -> None:
            try:
                results[i] = await work(self.engines[e], item)
            finally:
                async with freed:
                    self.in_flight[e] -= 1
                    freed.notify_all()

        try:
            async with asyncio.TaskGroup() as group:
                for i, item in enumerate(items):
                    async with freed:
                        await freed.wait_for(lambda: self.least_loaded() is not None)
                        e = self.least_loaded()
                        assert e is not None
                        self.in_flight[e] += 1
                        self.record.peak_in_flight[e] = max(self.record.peak_in_flight[e], self.in_flight[e])
                    self.record.engine_of[i] = e
                    group.create_task(one(i, e, item))
        except BaseExceptionGroup as failed:  # the first failure, as itself (the others were its fallout)
            raise failed.exceptions[0] from None
        return [results[i] for i in range(len(items))]
