"""A group of Ray actors (one per rank) and the one way to call them: `RayGroup.call`.

Owns placement (a placement group per device group; colocated roles share one group's bundles and
process) and dispatch. Must not know what the ranks compute.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy


@dataclass(frozen=True)
class Resources:
    """Per-process request: derived from the spec and what the cluster has (no magic fractions)."""

    cpus: float
    gpus: float
    custom: dict[str, float]

    def bundle(self) -> dict[str, float]:
        b = {"CPU": self.cpus, **self.custom}
        if self.gpus:
            b["GPU"] = self.gpus
        return b


class RayGroup:
    """world_size Ray actors of `cls`, one per bundle of its own placement group."""

    def __init__(
        self,
        name: str,
        cls: type,
        world_size: int,
        res: Resources,
        init_args: Sequence[Sequence[Any]],
        env: dict[str, str] | None = None,
        max_concurrency: int = 1,
    ) -> None:
        self.name = name
        self.world_size = world_size
        self.pg: PlacementGroup = placement_group(
            [res.bundle() for _ in range(world_size)], strategy="PACK", name=f"rlhf-{name}"
        )
        remote_cls: Any = ray.remote(cls)
        self.handles: list[Any] = [
            remote_cls.options(  # type: ignore[attr-defined]
                num_cpus=res.cpus,
                num_gpus=res.gpus,
                resources=res.custom or None,
                name=None,
                max_concurrency=max_concurrency,
                runtime_env={"env_vars": env} if env else None,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.pg, placement_group_bundle_index=rank
                ),
            ).remote(*init_args[rank])
            for rank in range(world_size)
        ]

    def call(
        self,
        method: str,
        *args: Any,
        per_rank: Sequence[Sequence[Any]] | None = None,
        ranks: Sequence[int] | None = None,
        num_returns: int = 1,
        **kwargs: Any,
    ) -> list[Any]:
        """Call `method` on every rank (or `ranks`): shared args, or per-rank positional args. Returns refs."""
        chosen = list(ranks) if ranks is not None else list(range(self.world_size))
        refs = []
        for rank in chosen:
            fn = getattr(self.handles[rank], method)
            if num_returns != 1:
                fn = fn.options(num_returns=num_returns)
            call_args = tuple(per_rank[rank]) if per_rank is not None else args
            refs.append(fn.remote(*call_args, **kwargs))
        return refs

    def get(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        return list(ray.get(self.call(method, *args, **kwargs)))

    def shutdown(self) -> None:
        for h in self.handles:
            ray.kill(h, no_restart=True)
        remove_placement_group(self.pg)
