"""The device plan: which process of the job uses which GPU, decided from the spec alone (never the head's).

Owns the pools (one Ray placement group each, one bundle per GPU), which process runs in which bundle and
what share of its GPU it asks for, and checking an observed map of (pod, GPU ids) per process against the
plan. GPUs are whole per rank; a bundle is shared only by roles the spec colocates (actor rank i with
engine i under colocateAll, the reward model with critic rank 0), never by fractions Ray may pack
elsewhere. Pure: must not import Ray, torch or anything that starts a process.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from rlhf_api.spec import RLHFJobSpec

PlanRole = Literal["actor", "critic", "reference", "reward", "engine"]
MODEL_ROLES: tuple[PlanRole, ...] = ("actor", "critic", "reference")


@dataclass(frozen=True)
class Pool:
    """One placement group: `bundles` bundles of one GPU each, on the `pod_role` pods."""

    name: str
    pod_role: Literal["trainer", "rollout"]
    bundles: int
    strategy: Literal["PACK", "STRICT_PACK"] = "PACK"


@dataclass(frozen=True)
class Process:
    """One Ray actor: the roles it hosts, its rank, and its GPUs as bundles of `pool`.

    `share` is the GPU it asks for in each of its bundles: 1 / (processes placed in that bundle). A
    tensor-parallel engine spans several bundles; its actor sits in the first and vLLM's workers take
    the rest."""

    name: str
    roles: tuple[PlanRole, ...]
    rank: int
    pool: str
    bundles: tuple[int, ...]
    shares: tuple[float, ...]


@dataclass(frozen=True)
class DevicePlan:
    pools: tuple[Pool, ...]
    processes: tuple[Process, ...]

    def pool(self, name: str) -> Pool:
        return next(p for p in self.pools if p.name == name)

    def of_pool(self, name: str) -> list[Process]:
        return [p for p in self.processes if p.pool == name]

    def bundle_users(self, pool: str) -> dict[int, int]:
        """Bundle index -> the processes of `pool` placed in it."""
        users: dict[int, int] = defaultdict(int)
        for p in self.of_pool(pool):
            for b in p.bundles:
                users[b] += 1
        return dict(users)

    def gpus(self, pod_role: str | None = None) -> int:
        """GPUs the plan uses (one per bundle), on the pods of `pod_role` or on all."""
        return sum(p.bundles for p in self.pools if pod_role is None or p.pod_role == pod_role)


@dataclass(frozen=True)
class Observed:
    """Where one process of the plan turned out to run: its pod (hostname) and Ray's GPU ids there."""

    process: str
    pod: str
    gpus: tuple[int, ...]


def plan(spec: RLHFJobSpec, engines: int | None = None) -> DevicePlan:
    """The job's pools and processes; `engines` overrides spec.rollout.engines (the pool is elastic)."""
    n_engines = spec.rollout.engines if engines is None else engines
    tp = spec.rollout.tensor_parallel_size
    pools: list[Pool] = []
    slots: list[tuple[str, tuple[PlanRole, ...], int, str, tuple[int, ...]]] = []
    reward_model = spec.model.reward.type == "model"
    reward_home: tuple[str, int] | None = None
    for group_roles, placement in spec.gpu_groups():
        hosted = tuple(r for r in group_roles if r != "reward")
        if not hosted:
            continue
        name = "+".join(hosted)
        pools.append(Pool(name, "trainer", placement.ranks))
        slots.extend((f"{name}/{r}", hosted, r, name, (r,)) for r in range(placement.ranks))
        if "reward" in group_roles:
            reward_home = (name, 0)  # colocated: the reward model shares the first GPU of its group
    if reward_model:
        if reward_home is None:
            pools.append(Pool("reward", "trainer", 1))
            reward_home = ("reward", 0)
        slots.append(("reward", ("reward",), 0, reward_home[0], (reward_home[1],)))
    for e in range(n_engines):
        if spec.trainer.colocate_all:  # engine e shares the GPUs of actor ranks e*TP .. e*TP+TP-1
            host = pools[0].name
            slots.append((f"engine-{e}", ("engine",), e, host, tuple(range(e * tp, (e + 1) * tp))))
        else:
            pools.append(Pool(f"engine-{e}", "rollout", tp, "STRICT_PACK"))
            slots.append((f"engine-{e}", ("engine",), e, f"engine-{e}", tuple(range(tp))))
    users: dict[tuple[str, int], int] = defaultdict(int)
    for _, _, _, pool, bundles in slots:
        for b in bundles:
            users[(pool, b)] += 1
    processes = tuple(
        Process(name, roles, rank, pool, bundles, tuple(1.0 / users[(pool, b)] for b in bundles))
        for name, roles, rank, pool, bundles in slots
    )
    return DevicePlan(tuple(pools), processes)


def most_gpus(spec: RLHFJobSpec) -> int:
    """GPUs of the plan at the most engines the job may run (the autoscaler's maximum): what a local Ray
    started under the CPU stand-in advertises as logical GPUs."""
    auto = spec.rollout.autoscaling
    return plan(spec, max(spec.rollout.engines, auto.max_engines if auto.enabled else 0)).gpus()


def expected_sharing(device_plan: DevicePlan) -> dict[str, frozenset[str]]:
    """For each process, the processes it must share each of its GPUs with (same pool and bundle)."""
    by_slot: dict[tuple[str, int], set[str]] = defaultdict(set)
    for p in device_plan.processes:
        for b in p.bundles:
            by_slot[(p.pool, b)].add(p.name)
    return {
        p.name: frozenset(n for b in p.bundles for n in by_slot[(p.pool, b)] if n != p.name)
        for p in device_plan.processes
    }


def problems(
    device_plan: DevicePlan, observed: Iterable[Observed], pod_gpus: Mapping[str, int] | None = None
) -> list[str]:
    """What breaks the plan's invariants in an observed map (empty: it holds).

    - every process of the plan ran, with exactly one GPU per bundle;
    - no two ranks of one role share a GPU, and processes share a GPU only where the plan colocates them;
    - with `pod_gpus` (pod -> its GPUs), no more GPUs idle than the pods have beyond the plan's (the
      trainer pods all have the largest gpusPerNode, so a smaller group leaves some unused by design)."""
    seen = {o.process: o for o in observed}
    found: list[str] = []
    planned = {p.name: p for p in device_plan.processes}
    for name, p in planned.items():
        o = seen.get(name)
        if o is None:
            found.append(f"{name}: planned but not placed")
        elif len(o.gpus) != len(p.bundles) or len(set(o.gpus)) != len(o.gpus):
            found.append(
                f"{name}: planned {len(p.bundles)} whole GPU(s), got GPU ids {list(o.gpus)} on {o.pod}"
            )
    found.extend(f"{name}: placed but not in the plan" for name in seen if name not in planned)
    holders: dict[tuple[str, int], list[str]] = defaultdict(list)
    for o in seen.values():
        for g in o.gpus:
            holders[(o.pod, g)].append(o.process)
    sharing = expected_sharing(device_plan)
    for (pod, gpu), names in sorted(holders.items()):
        for name in names:
            if name not in planned:
                continue
            extra = sorted(set(names) - {name} - sharing[name])
            if extra:
                found.append(
                    f"{name}: shares GPU {gpu} of {pod} with {', '.join(extra)}, which the spec does not colocate with it"
                )
        for role in (*MODEL_ROLES, "reward", "engine"):
            same = [n for n in names if n in planned and role in planned[n].roles]
            if len(same) > 1:
                found.append(
                    f"GPU {gpu} of {pod} holds {len(same)} {role} processes: {', '.join(sorted(same))}"
                )
    if pod_gpus is not None:
        idle = idle_gpus(holders.keys(), pod_gpus)
        surplus = sum(pod_gpus.values()) - device_plan.gpus()  # pods sized to the largest gpusPerNode
        if sum(len(g) for g in idle.values()) > surplus:
            found.extend(
                f"{pod}: GPU(s) {gpus} idle, which the plan meant to use" for pod, gpus in idle.items()
            )
    return list(dict.fromkeys(found))


def idle_gpus(used: Iterable[tuple[str, int]], pod_gpus: Mapping[str, int]) -> dict[str, list[int]]:
    """pod -> the GPUs of it no process uses."""
    taken = set(used)
    idle = {pod: [g for g in range(n) if (pod, g) not in taken] for pod, n in sorted(pod_gpus.items())}
    return {pod: gpus for pod, gpus in idle.items() if gpus}


def device_rows(device_plan: DevicePlan, observed: Iterable[Observed]) -> list[dict[str, object]]:
    """The map as `rlhf plan --output json` prints it: one entry per rank of each model role (colocated
    roles of one process get one entry each), per reward-model process, and per engine."""
    seen = {o.process: o for o in observed}
    rows: list[dict[str, object]] = []
    for p in device_plan.processes:
        o = seen.get(p.name)
        for role in p.roles:
            rows.append(
                {
                    "role": role,
                    "rank": p.rank,
                    "pod": o.pod if o else "",
                    "gpus": list(o.gpus) if o else [],
                }
            )
    return rows


def table(device_plan: DevicePlan, observed: Iterable[Observed]) -> str:
    """The device map as a fixed-width table (printed at start and by `rlhf plan`)."""
    seen = {o.process: o for o in observed}
    lines = [f"{'PROCESS':<28} {'ROLES':<28} {'POD':<40} {'GPUS':<12} SHARED WITH"]
    sharing = expected_sharing(device_plan)
    for p in device_plan.processes:
        o = seen.get(p.name)
        gpus = ",".join(str(g) for g in o.gpus) if o else "-"
        shared = ", ".join(sorted(sharing[p.name])) or "-"
        lines.append(f"{p.name:<28} {'+'.join(p.roles):<28} {(o.pod if o else '-'):<40} {gpus:<12} {shared}")
    return "\n".join(lines)
