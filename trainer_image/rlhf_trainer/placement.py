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
from rlhf_api.constants import ROLLOUT_RESOURCE, TRAINER_RESOURCE
from rlhf_api.spec import RLHFJobSpec
from transformers import AutoTokenizer

from rlhf_trainer.config import data_parallel_size, engine_options, model_settings
from rlhf_trainer.device import DeviceInfo
from rlhf_trainer.groups import RayGroup, Resources
from rlhf_trainer.metrics import TrainerExporter
from rlhf_trainer.rollout.pool import EnginePool
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

    @property
    def actor(self) -> RayGroup:
        return self.roles["actor"]

    @property
    def critic(self) -> RayGroup | None:
        return self.roles.get("critic")

    def call_role(self, role: str, method: str, shards: dict[int, list[Any]], micro_batch: int) -> list[Any]:
        """Run an experience phase on the group hosting `role`. Its ranks form D data-parallel groups of
        SP ranks (contiguous blocks); rank w is in group w // SP and takes shards s with s % D == w // SP.
        Every rank of an SP group gets the same refs and pulls the chunks itself: nothing is broadcast."""
        group = self.roles[role]
        W = group.world_size
        sp = self.sequence_parallel[group.name]
        D = W // sp
        per_rank = [
            ({s: refs for s, refs in shards.items() if s % D == w // sp}, micro_batch) for w in range(W)
        ]
        refs = group.call(method, per_rank=per_rank)
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
        self.pool.shutdown()


def process_count(spec: RLHFJobSpec) -> int:
    """Ray processes the job runs: model ranks, engines and the reward scorer."""
    n = sum(p.ranks for roles, p in spec.gpu_groups() if set(roles) - {"reward"})
    return int(n + spec.rollout.engines + 1)


def reward_config(spec: RLHFJobSpec) -> dict[str, Any]:
    """`model.reward` as the scorer reads it: by field name (`timeout_seconds`, `concurrency`). The spec
    dumps by its CRD aliases (`timeoutSeconds`), which the scorer would not find."""
    return spec.model.reward.model_dump(by_alias=False)


def sharers_per_device(spec: RLHFJobSpec, roles: tuple[str, ...]) -> int:
    """How many processes share each device of `roles` (a gpu_groups() group, ("reward",) or ("engine",)).

    colocateAll: every device of the actor runs a model rank and an engine (and the reward model, if
    any). A reward model colocated with the critic shares the critic's devices. Otherwise one each.
    """
    reward_model = spec.model.reward.type == "model"
    if spec.trainer.colocate_all:
        return 2 + int(reward_model)
    critic_and_reward = reward_model and spec.algorithm.uses_critic and spec.trainer.critic_reward_colocated
    if critic_and_reward and ("reward" in roles or "critic" in roles):
        return 2
    return 1


def _resources(spec: RLHFJobSpec, custom: str | None, gpus: float) -> Resources:
    resources = ray.cluster_resources()  # type: ignore[no-untyped-call]
    total_cpu = float(resources.get("CPU", 1.0))
    cpus = min(1.0, total_cpu / max(1, process_count(spec)))
    have_custom = custom is not None and resources.get(custom, 0) > 0
    return Resources(cpus=cpus, gpus=gpus, custom={custom: 1.0} if have_custom and custom else {})


def place(spec: RLHFJobSpec, info: DeviceInfo, log: Callable[[str], None]) -> Placed:
    """Start the model groups, the reward scorer and the engine pool (engines start in the background)."""
    gpu = 0.0 if info.is_cpu else 1.0
    cores = os.cpu_count() or 1
    env = {"DS_ACCELERATOR": "cpu", "RLHF_DEVICE": "cpu"} if info.is_cpu else {}
    groups: list[RayGroup] = []
    roles: dict[str, RayGroup] = {}
    sequence_parallel: dict[str, int] = {}
    for group_roles, placement in spec.gpu_groups():
        hosted = [r for r in group_roles if r != "reward"]
        if not hosted:
            continue
        name = "+".join(hosted)
        res = _resources(spec, TRAINER_RESOURCE, gpu / sharers_per_device(spec, group_roles))
        threads = max(1, cores // placement.ranks)
        sp = spec.trainer.sequence_parallel_for(placement.ranks)
        args = [(name, hosted, r, placement.ranks, info.kind, threads, sp) for r in range(placement.ranks)]
        group = RayGroup(name, ModelRank, placement.ranks, res, args, env=env)
        groups.append(group)
        sequence_parallel[name] = sp
        roles.update({role: group for role in hosted})
        log(
            f"placed {name}: {placement.ranks} rank(s), {res.bundle()} per rank"
            + (f", sequence parallel {sp}" if sp > 1 else "")
        )
    # Reward scorer: a threaded actor (function/http), or the holder of the reward model.
    reward_gpu = gpu / sharers_per_device(spec, ("reward",)) if spec.model.reward.type == "model" else 0.0
    reward_res = _resources(spec, None, reward_gpu)
    reward = (
        ray.remote(RewardScorer)
        .options(  # type: ignore[attr-defined]
            num_cpus=reward_res.cpus,
            num_gpus=reward_res.gpus,
            resources=reward_res.custom or None,
            max_concurrency=spec.model.reward.concurrency + 1,
            runtime_env={"env_vars": env} if env else None,
        )
        .remote(reward_config(spec), info.kind)
    )
    engine_gpu = float(spec.rollout.tensor_parallel_size) * gpu / sharers_per_device(spec, ("engine",))
    pool = EnginePool(
        engine_options(spec, info, cores),
        _resources(spec, ROLLOUT_RESOURCE, engine_gpu),
        spec.rollout.tensor_parallel_size,
    )
    return Placed(tuple(groups), roles, sequence_parallel, pool, reward)


def start(placed: Placed, spec: RLHFJobSpec, metrics: TrainerExporter, log: Callable[[str], None]) -> None:
    """Set up every rank (torch.distributed, DeepSpeed engines), the reward scorer and the engines."""
    t0 = time.perf_counter()
    placed.pool.resize(placed.pool.desired_from_cluster(spec.rollout.engines))
    tok = AutoTokenizer.from_pretrained(spec.model.actor)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    settings = model_settings(spec, int(pad_id))
    setups: list[Any] = []
    for group in placed.groups:
        addr, port = ray.get(group.handles[0].address.remote())
        setups.append(group.call("setup", addr, port, settings))
    for group, refs in zip(placed.groups, setups, strict=True):
        for rank, done in enumerate(ray.get(refs)):
            placed.pids[f"{group.name}/{rank}"] = int(done["pid"])
    placed.pids["reward"] = int(ray.get(placed.reward.ready.remote())["pid"])
    placed.pool.wait_ready()
    placed.actor.get("weight_plan", spec.weight_sync.bucket_size_mib * 1024 * 1024)
    metrics.set_engines(placed.pool.counts())
    log(f"groups ready in {time.perf_counter() - t0:.1f}s; engines: {placed.pool.counts()}")


def shards_of(spec: RLHFJobSpec) -> int:
    """Rollout shards per step: one per data-parallel (SP) group of actor ranks."""
    return data_parallel_size(spec, spec.trainer.actor.ranks)
