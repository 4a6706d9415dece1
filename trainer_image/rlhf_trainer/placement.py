"""Placement: the spec's model groups, rollout engine pool and reward scorer as Ray actors (`Placed`).

Owns how many processes go where (resources per process derived from the spec and the cluster, devices
shared by colocated roles), starting them, and calling a role's group for an experience phase. Must not
decide what a step does (loop.py) nor move rollout data: it hands out actor handles and object refs.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup
from rlhf_api.constants import POD_SLOTS_ENV, ROLLOUT_RESOURCE, TRAINER_RESOURCE
from rlhf_api.spec import RLHFJobSpec

from rlhf_trainer import device_plan
from rlhf_trainer.agents.runner import AgentRunner
from rlhf_trainer.config import (
    InputError,
    agent_options,
    data_parallel_size,
    engine_options,
    model_settings,
)
from rlhf_trainer.device import DeviceInfo
from rlhf_trainer.device_plan import DevicePlan, Observed, Pool, Process
from rlhf_trainer.groups import RayGroup, Resources, in_bundle, make_pool
from rlhf_trainer.metrics import TrainerExporter
from rlhf_trainer.rollout.pool import EnginePlacer, EnginePool
from rlhf_trainer.workers.rank import ModelRank
from rlhf_trainer.workers.reward import RewardScorer


@dataclass(frozen=True)
class Placed:
    """What placement made: model groups (one per device group), the engine pool and the reward scorer."""

    groups: tuple[RayGroup, ...]
    roles: Mapping[str, RayGroup]  # role -> the group hosting it (colocated roles share one)
    sequence_parallel: Mapping[str, int]  # group name -> its SP size (1: whole sequences)
    pool: EnginePool
    reward: Any  # the RewardScorer actor handle
    pids: dict[str, int] = field(default_factory=dict)  # "<group>/<rank>" and "reward" -> pid, by start()
    plan: DevicePlan | None = None  # the device plan the processes were placed by
    plan_spec: RLHFJobSpec | None = None
    agent: Any = None  # the AgentRunner actor handle (rollout.agent), else None

    @property
    def actor(self) -> RayGroup:
        return self.roles["actor"]

    @property
    def critic(self) -> RayGroup | None:
        return self.roles.get("critic")

    def launch_role(
        self, role: str, method: str, shards: dict[int, list[Any]], micro_batch: int
    ) -> list[Any]:
        """Launch an experience phase on the group hosting `role` and return its refs, without waiting.
        Its ranks form D data-parallel groups of SP ranks (contiguous blocks); rank w is in group w // SP
        and takes shards s with s % D == w // SP. Every rank of an SP group gets the same refs and pulls
        the chunks itself: nothing is broadcast."""
        group = self.roles[role]
        W = group.world_size
        sp = self.sequence_parallel[group.name]
        D = W // sp
        per_rank = [
            ({s: refs for s, refs in shards.items() if s % D == w // sp}, micro_batch) for w in range(W)
        ]
        return group.call(method, per_rank=per_rank)

    def call_role(self, role: str, method: str, shards: dict[int, list[Any]], micro_batch: int) -> list[Any]:
        """`launch_role`, then wait for every rank (an error surfaces here, in the caller's phase)."""
        refs = self.launch_role(role, method, shards, micro_batch)
        ray.wait(refs, num_returns=len(refs))
        ray.get(refs)  # surface errors inside the phase that caused them
        return list(refs)

    def new_step(self) -> None:
        """Every rank drops the last step's rollout shards."""
        ray.get([ref for g in self.groups for ref in g.call("new_step")])

    def victim(self, phase: str) -> tuple[str, int]:
        """(who, pid) of the actor whose death hurts this phase most (fault injection): the engine
        generating, the reward worker scoring, the last critic rank in the critic's phases, otherwise the
        last actor rank (training, weight sync)."""
        if phase == "generation":
            return "rollout engine 0", int(self.pool.ready()[0].info["pid"])
        if phase == "reward":
            return "reward worker", self.pids["reward"]
        group = self.critic if phase in ("critic_values", "critic_train") and self.critic else self.actor
        role = "critic" if group is self.critic else "actor"
        last = group.world_size - 1
        return f"{role} rank {last}", self.pids[f"{group.name}/{last}"]

    def shutdown(self) -> None:
        for g in self.groups:
            with contextlib.suppress(Exception):
                g.shutdown()
        if self.agent is not None:
            with contextlib.suppress(Exception):
                ray.kill(self.agent)
        self.pool.shutdown()


def process_count(spec: RLHFJobSpec) -> int:
    """Ray processes the job runs: model ranks, engines and the reward scorer."""
    n = sum(p.ranks for roles, p in spec.gpu_groups() if set(roles) - {"reward"})
    return int(n + spec.rollout.engines + 1)


def reward_config(spec: RLHFJobSpec) -> dict[str, Any]:
    """`model.reward` as the scorer reads it: by field name (`timeout_seconds`, `concurrency`). The spec
    dumps by its CRD aliases (`timeoutSeconds`), which the scorer would not find."""
    return spec.model.reward.model_dump(by_alias=False)


def cpus_per_process(spec: RLHFJobSpec) -> float:
    """At most one CPU per process, less when the cluster has fewer CPUs than the job has processes."""
    total_cpu = float(ray.cluster_resources().get("CPU", 1.0))  # type: ignore[no-untyped-call]
    return min(1.0, total_cpu / max(1, process_count(spec)))


def pool_bundles(pool: Pool, users: Mapping[int, int], cpus: float) -> list[dict[str, float]]:
    """One bundle per GPU of `pool`: the GPU, a CPU share per process placed in it, and the pod role's
    custom resource (`trainer` per GPU; `rollout` once per engine) where the job's pods advertise it:
    always in the operator's RayCluster (POD_SLOTS_ENV), so a group waits for its own pods instead of
    taking another role's GPU while pods rejoin; otherwise where the cluster advertises it now."""
    have = ray.cluster_resources()  # type: ignore[no-untyped-call]
    custom = TRAINER_RESOURCE if pool.pod_role == "trainer" else ROLLOUT_RESOURCE
    required = os.environ.get(POD_SLOTS_ENV) == "1" or have.get(custom, 0) > 0
    bundles: list[dict[str, float]] = []
    for b in range(pool.bundles):
        bundle = {"CPU": cpus * max(1, users.get(b, 1)), "GPU": 1.0}
        if required and (pool.pod_role == "trainer" or b == 0):
            bundle[custom] = 1.0
        bundles.append(bundle)
    return bundles


def trainer_pools(plan: DevicePlan, cpus: float) -> dict[str, PlacementGroup]:
    """The placement groups of the plan's trainer-pod pools (engines make theirs as they start)."""
    return {
        pool.name: make_pool(
            pool_bundles(pool, plan.bundle_users(pool.name), cpus), pool.strategy, f"rlhf-{pool.name}"
        )
        for pool in plan.pools
        if pool.pod_role == "trainer"
    }


def options_for(p: Process, pg: PlacementGroup, cpus: float, info: DeviceInfo) -> dict[str, Any]:
    """Ray options placing process `p` in its first bundle with its share of that bundle's GPU. A CUDA
    tensor-parallel engine's actor takes no GPU itself: vLLM's workers, its child tasks, take the bundles."""
    tp_actor = p.roles == ("engine",) and len(p.bundles) > 1 and not info.is_cpu
    share = 0.0 if tp_actor else p.shares[0]
    return in_bundle(pg, p.bundles[0], Resources(cpus=cpus, gpus=share, custom={}), capture_children=tp_actor)


def place(spec: RLHFJobSpec, info: DeviceInfo, log: Callable[[str], None]) -> Placed:
    """Start the model groups, the reward scorer and the engine pool (engines start in the background),
    each process in its bundle of the device plan's pools."""
    plan = device_plan.plan(spec)
    cores = os.cpu_count() or 1
    cpus = cpus_per_process(spec)
    env = {"DS_ACCELERATOR": "cpu", "RLHF_DEVICE": "cpu"} if info.is_cpu else {}
    pgs = trainer_pools(plan, cpus)
    groups: list[RayGroup] = []
    roles: dict[str, RayGroup] = {}
    sequence_parallel: dict[str, int] = {}
    for group_roles, placement in spec.gpu_groups():
        hosted = [r for r in group_roles if r != "reward"]
        if not hosted:
            continue
        name = "+".join(hosted)
        ranks = [p for p in plan.of_pool(name) if p.roles != ("reward",) and p.roles != ("engine",)]
        threads = max(1, cores // placement.ranks)
        sp = spec.trainer.sequence_parallel_for(placement.ranks)
        args = [(name, hosted, r, placement.ranks, info.kind, threads, sp) for r in range(placement.ranks)]
        options = [options_for(p, pgs[name], cpus, info) for p in ranks]
        group = RayGroup(name, ModelRank, pgs[name], options, args, env=env)
        groups.append(group)
        sequence_parallel[name] = sp
        roles.update({role: group for role in hosted})
        shared = sorted({p.shares[0] for p in ranks})
        log(
            f"placed {name}: {placement.ranks} rank(s), one GPU each"
            + (f" (shared: {', '.join(f'{s:g}' for s in shared)} of it)" if shared != [1.0] else "")
            + (f", sequence parallel {sp}" if sp > 1 else "")
        )
    # Reward scorer: a threaded actor (function/http), or the holder of the reward model (its bundle).
    reward_proc = next((p for p in plan.processes if p.roles == ("reward",)), None)
    if reward_proc is not None:
        if reward_proc.pool not in pgs:
            raise RuntimeError(f"the reward model's pool {reward_proc.pool} was not created")
        reward_opts = options_for(reward_proc, pgs[reward_proc.pool], cpus, info)
    else:
        reward_opts = {"num_cpus": cpus, "num_gpus": 0}
    reward = (
        ray.remote(RewardScorer)
        .options(  # type: ignore[attr-defined]
            **reward_opts,
            max_concurrency=spec.model.reward.concurrency + 1,
            runtime_env={"env_vars": env} if env else None,
        )
        .remote(reward_config(spec), info.kind)
    )
    pool = EnginePool(
        engine_options(spec, info, cores),
        engine_placer(spec, plan, pgs, cpus, info),
        spec.rollout.tensor_parallel_size,
    )
    agent = place_agent_runner(spec, env)
    return Placed(
        tuple(groups), roles, sequence_parallel, pool, reward, plan=plan, plan_spec=spec, agent=agent
    )


def place_agent_runner(spec: RLHFJobSpec, env: dict[str, str]) -> Any:
    """rollout.agent's runner: an async actor holding no device (it waits on the engines and runs tools in
    its threads), or None without an agent."""
    options = agent_options(spec)
    if options is None:
        return None
    runner: Any = ray.remote(AgentRunner)
    return runner.options(num_cpus=0, runtime_env={"env_vars": env} if env else None).remote(options)


def engine_placer(
    spec: RLHFJobSpec, plan: DevicePlan, pgs: Mapping[str, PlacementGroup], cpus: float, info: DeviceInfo
) -> EnginePlacer:
    """Engine i's placement: under colocateAll the bundles of actor ranks i*TP.., else a placement group
    of its own with TP bundles on one rollout pod (the pool is elastic: made when the engine starts)."""
    engines = [p for p in plan.processes if p.roles == ("engine",)]

    def placer(index: int) -> tuple[dict[str, Any], PlacementGroup | None]:
        if spec.trainer.colocate_all:
            p = engines[index % len(engines)]
            return options_for(p, pgs[p.pool], cpus, info), None
        tp = spec.rollout.tensor_parallel_size
        own = Pool(f"engine-{index}", "rollout", tp, "STRICT_PACK")
        p = Process(own.name, ("engine",), index, own.name, tuple(range(tp)), (1.0,) * tp)
        pg = make_pool(pool_bundles(own, {}, cpus), own.strategy, f"rlhf-{own.name}")
        return options_for(p, pg, cpus, info), pg

    return placer


def observe(placed: Placed, timeout: float | None = None) -> list[Observed]:
    """Where every process of the plan runs: each rank's, the reward model's and each ready engine's
    pod and GPU ids. Raises InputError with the process's own message when one does not see its GPU.
    Waits for the processes to be placed (pods may still be starting); the operator's stall detection
    covers a job that never is."""
    found: dict[str, dict[str, Any]] = {}
    for group in placed.groups:
        for rank, where in enumerate(ray.get(group.call("where"), timeout=timeout)):
            found[f"{group.name}/{rank}"] = where
    if placed.plan is not None and any(p.roles == ("reward",) for p in placed.plan.processes):
        found["reward"] = ray.get(placed.reward.where.remote(), timeout=timeout)
    for i, slot in enumerate(sorted(placed.pool.ready(), key=lambda s: s.index)):
        found[f"engine-{i}"] = slot.info
    bad = [w["problem"] for w in found.values() if "problem" in w]
    if bad:
        more = f" (and {len(bad) - 1} more process(es) alike)" if len(bad) > 1 else ""
        raise InputError(bad[0] + more)
    return [
        Observed(name, str(w.get("pod", "")), tuple(int(g) for g in w.get("gpus", [])))
        for name, w in found.items()
    ]


def check_devices(placed: Placed, log: Callable[[str], None]) -> None:
    """Print the device map and refuse to start (an input error: no restart) when it breaks the plan."""
    if placed.plan is None:
        return
    observed = observe(placed)
    current = (
        device_plan.plan(placed.plan_spec, engines=len(placed.pool.ready()))
        if placed.plan_spec
        else placed.plan
    )
    log("device map:\n" + device_plan.table(current, observed))
    found = device_plan.problems(current, observed)
    if found:
        raise InputError("the device map breaks the plan: " + "; ".join(found))


def start(placed: Placed, spec: RLHFJobSpec, metrics: TrainerExporter, log: Callable[[str], None]) -> None:
    """Set up every rank (torch.distributed, DeepSpeed engines), the reward scorer and the engines."""
    t0 = time.perf_counter()
    placed.pool.resize(placed.pool.desired_from_cluster(spec.rollout.engines))
    observe(placed)  # before any model loads: a rank that sees no GPU it was promised fails the job here
    from transformers import AutoTokenizer  # here: `rlhf plan` places with this module and loads no model

    tok = AutoTokenizer.from_pretrained(spec.model.actor)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    settings = model_settings(spec, int(pad_id))
    setups: list[Any] = []
    for group in placed.groups:
        addr, port = ray.get(group.handles[0].address.remote())
        setups.append(group.call("setup", addr, port, settings))
    packing: dict[str, bool] = {}
    for group, refs in zip(placed.groups, setups, strict=True):
        for rank, done in enumerate(ray.get(refs)):
            placed.pids[f"{group.name}/{rank}"] = int(done["pid"])
            packing.update(done.get("packing", {}))
    if spec.trainer.packing:  # packing falls back per role (deepspeed_utils.resolve_packing): say where
        log(
            "packed micro-batches: "
            + ", ".join(f"{r} {'on' if on else 'OFF'}" for r, on in sorted(packing.items()))
        )
    placed.pids["reward"] = int(ray.get(placed.reward.ready.remote())["pid"])
    if placed.agent is not None:  # its agent function loads here: a bad rollout.agent fails the start
        placed.pids["agent"] = int(ray.get(placed.agent.ready.remote())["pid"])
    placed.pool.wait_ready()
    check_devices(placed, log)
    placed.actor.get("weight_plan", spec.weight_sync.bucket_size_mib * 1024 * 1024)
    metrics.set_engines(placed.pool.counts())
    log(f"groups ready in {time.perf_counter() - t0:.1f}s; engines: {placed.pool.counts()}")


def shards_of(spec: RLHFJobSpec) -> int:
    """Rollout shards per step: one per data-parallel (SP) group of actor ranks."""
    return data_parallel_size(spec, spec.trainer.actor.ranks)
