"""A group of Ray actors (one per rank) and the one way to call them: `RayGroup.call`.

Owns the Ray mechanics of placement (a process in a bundle of a placement group, with its GPU share
there) and dispatch. What goes where is device_plan's; this module must not know what the ranks compute.
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
    """One process's request: CPUs, its share of each of its bundles' GPU, and custom resources."""

    cpus: float
    gpus: float
    custom: dict[str, float]

    def bundle(self) -> dict[str, float]:
        b = {"CPU": self.cpus, **self.custom}
        if self.gpus:
            b["GPU"] = self.gpus
        return b


def in_bundle(
    pg: PlacementGroup, bundle: int, res: Resources, capture_children: bool = False
) -> dict[str, Any]:
    """Ray `.options(...)` that put one process in `bundle` of `pg` with `res` (its GPU share there)."""
    return {
        "num_cpus": res.cpus,
        "num_gpus": res.gpus,
        "resources": res.custom or None,
        "scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=pg,
            placement_group_bundle_index=bundle,
            placement_group_capture_child_tasks=capture_children,
        ),
    }


def make_pool(bundles: list[dict[str, float]], strategy: str, name: str) -> PlacementGroup:
    """A placement group: one bundle per GPU (the device plan's pool)."""
    pg: PlacementGroup = placement_group(bundles, strategy=strategy, name=name)
    return pg


class RayGroup:
    """world_size Ray actors of `cls`, rank r placed with `options[r]` (a bundle of the group's pool `pg`)."""

    def __init__(
        self,
        name: str,
        cls: type,
        pg: PlacementGroup,
        options: Sequence[dict[str, Any]],
        init_args: Sequence[Sequence[Any]],
        env: dict[str, str] | None = None,
        max_concurrency: int = 1,
    ) -> None:
        self.name = name
        self.world_size = len(options)
        self.pg = pg
        remote_cls: Any = ray.remote(cls)
        self.handles: list[Any] = [
            remote_cls.options(  # type: ignore[attr-defined]
                **options[rank],
                max_concurrency=max_concurrency,
                runtime_env={"env_vars": env} if env else None,
            ).remote(*init_args[rank])
            for rank in range(self.world_size)
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
