"""One rank of a model group: a Ray actor process hosting the models that share its devices.

Owns the process-level setup (torch.distributed over gloo/nccl, DeepSpeed engines of the hosted roles)
and this rank's data shards for the current step: packed rollouts are pulled from the object store here,
by reference, never through the driver. The driver tells it what to do; the math lives elsewhere.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

import torch

from rlhf_trainer import device, experience, sequence_parallel
from rlhf_trainer.fault_env import maybe_hang
from rlhf_trainer.stacks import dump as stacks
from rlhf_trainer.stacks import nccl
from rlhf_trainer.startup_imports import gc_paused
from rlhf_trainer.step_settings import AlgorithmSettings
from rlhf_trainer.transfer import PackedRollout
from rlhf_trainer.weight_sync.bucketing import plan_bytes
from rlhf_trainer.weight_sync.channels import Rendezvous, WeightChannel, open_channel
from rlhf_trainer.workers.deepspeed_utils import all_reduce_sum, init_distributed
from rlhf_trainer.workers.policy import PolicyLoss, PolicyModel
from rlhf_trainer.workers.reference import ReferenceModel
from rlhf_trainer.workers.value import ValueModel


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def node_ip() -> str:
    import ray

    return str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]


class ModelRank:
    """Hosts any of: actor (PolicyModel), reference, critic (ValueModel)."""

    def __init__(
        self,
        group: str,
        roles: list[str],
        rank: int,
        world_size: int,
        dev: str,
        threads: int,
        sp_size: int = 1,
    ) -> None:
        self.group = group
        self.sp_size = sp_size
        self.sp: Any = None  # sequence_parallel.SequenceParallel once setup ran (sp_size > 1)
        self.roles = roles
        self.rank = rank
        self.world_size = world_size
        self.info = device.DeviceInfo(dev, "nccl" if dev == "cuda" else "gloo")
        device.configure_process(self.info, threads)
        self.models: dict[str, Any] = {}
        self.shards: dict[int, PackedRollout] = {}
        self.local: dict[int, dict[str, Any]] = {}
        self.channel: WeightChannel | None = None
        self.plan: list[Any] = []
        self.delta_sender: Any = None  # weight_sync.delta_wire.DeltaSender on rank 0 with weightSync.delta
        # Named by its main role in a stack snapshot ("actor rank 1" also for a rank hosting the reference).
        self.role = next((r for r in ("actor", "critic", "reference") if r in roles), group)
        stacks.arm(f"{self.role} rank {rank}", self.role, rank)

    # ---- setup ----------------------------------------------------------------------------------
    def where(self) -> dict[str, Any]:
        """Its pod and GPU ids, and a `problem` if it does not see the GPUs it was promised."""
        return device.whereabouts(self.info.kind, f"{self.group} rank {self.rank}")

    def nccl_transport(self) -> dict[str, Any]:
        """The network NCCL chose for this rank (its debug file; stacks.nccl), after a collective ran."""
        t = nccl.own_transport()
        return {"who": f"{self.role} rank {self.rank}", "network": t.network, "devices": t.devices}

    def address(self) -> tuple[str, int]:
        return node_ip(), free_port()

    def setup(
        self, master_addr: str, master_port: int, settings: dict[str, dict[str, Any]]
    ) -> dict[str, Any]:
        t0 = time.perf_counter()
        os.environ.update(
            {
                "MASTER_ADDR": master_addr,
                "MASTER_PORT": str(master_port),
                "RANK": str(self.rank),
                "WORLD_SIZE": str(self.world_size),
                "LOCAL_RANK": "0",
                "LOCAL_WORLD_SIZE": "1",
            }
        )
        if self.info.kind == "cuda":
            torch.cuda.set_device(0)
        # DeepSpeed's and transformers' imports and the models' build make long-lived objects only: no
        # collector passes meanwhile (startup_imports.py).
        with gc_paused():
            init_distributed(self.info.dist_backend)
            if self.sp_size > 1:
                self.sp = sequence_parallel.init_groups(self.sp_size)
            for role in self.roles:
                s = {
                    **settings[role],
                    "rank": self.rank,
                    "world_size": self.world_size,
                    "device": self.info.kind,
                }
                if role == "actor":
                    self.models[role] = PolicyModel(s["path"], s, self.sp)
                elif role == "critic":
                    self.models[role] = ValueModel(s["path"], s, self.sp)
                elif role == "reference":
                    self.models[role] = ReferenceModel(s["path"], s, self.sp)
                else:
                    raise ValueError(f"a model rank cannot host role {role!r}")
        return {
            "rank": self.rank,
            "roles": self.roles,
            "seconds": time.perf_counter() - t0,
            "pid": os.getpid(),
            # {role: packed micro-batches}: false where trainer.packing is, or fell back (resolve_packing)
            "packing": {role: bool(getattr(m, "packing", False)) for role, m in self.models.items()},
        }

    # ---- rollout shards -----------------------------------------------------------------------------
    def _load_shards(self, shard_refs: dict[int, list[Any]]) -> None:
        """Pull this step's packed chunks from the object store (once per step)."""
        import ray

        if set(shard_refs) == set(self.shards):
            return
        self.shards = {s: PackedRollout.concat(ray.get(refs)) for s, refs in sorted(shard_refs.items())}
        self.local = {s: {} for s in self.shards}

    @property
    def reports(self) -> bool:
        """Whether this rank reports results every rank of its SP group holds (only the first does)."""
        return self.sp is None or bool(self.sp.leader)

    def _combined(self) -> PackedRollout:
        return PackedRollout.concat([self.shards[s] for s in sorted(self.shards)])

    def new_step(self) -> None:
        self.shards = {}
        self.local = {}

    # ---- experience phases (each returns {shard: packed per-token tensor}) ---------------------------
    def ref_logprobs(self, shard_refs: dict[int, list[Any]], micro_batch: int) -> dict[int, torch.Tensor]:
        self._load_shards(shard_refs)
        model = self.models["reference"]
        out = {s: model.logprobs(r, micro_batch) for s, r in self.shards.items()}
        return out if self.reports else {}

    def critic_values(self, shard_refs: dict[int, list[Any]], micro_batch: int) -> dict[int, torch.Tensor]:
        self._load_shards(shard_refs)
        model = self.models["critic"]
        out = {s: model.values(r, micro_batch) for s, r in self.shards.items()}
        for s, v in out.items():
            self.local[s]["values"] = v
        return out if self.reports else {}

    def load_shards(self, shard_refs: dict[int, list[Any]], micro_batch: int) -> int:
        """Pull this step's shards when no experience phase did (grpo without a reference and with the
        old log-probs skipped); returns the samples held. `micro_batch`: call_role's signature."""
        del micro_batch
        self._load_shards(shard_refs)
        return sum(r.num_samples for r in self.shards.values())

    def old_logprobs(self, shard_refs: dict[int, list[Any]], micro_batch: int) -> int:
        self._load_shards(shard_refs)
        model = self.models["actor"]
        n = 0
        for s, r in self.shards.items():
            self.local[s]["old_logprobs"] = model.logprobs(r, micro_batch)
            n += int(r.response_lens.sum())
        return n

    # ---- advantages (actor ranks) -----------------------------------------------------------------
    def advantages(
        self,
        reward_refs: dict[int, list[Any]],
        ref_refs: list[Any],
        value_refs: list[Any],
        algo: AlgorithmSettings,
    ) -> tuple[dict[str, float], dict[int, dict[str, torch.Tensor]]]:
        """Scores -> advantages per shard, whitened over every actor rank's shards (a collective: all actor
        ranks call it together); returns (stats, {shard: {returns, valid}} for the critic)."""
        import ray

        ref_lp = _merge_shard_dicts(ray.get(ref_refs)) if ref_refs else {}
        values = _merge_shard_dicts(ray.get(value_refs)) if value_refs else {}
        inputs: dict[int, experience.ShardInputs] = {}
        for s, rollout in self.shards.items():
            results = ray.get(reward_refs[s])
            inputs[s] = experience.ShardInputs(
                scores=torch.cat([r.scores for r in results]),
                valid=torch.cat([r.valid for r in results]),
                response_lens=rollout.response_lens,
                group=rollout.group,
                loss_mask=rollout.loss_mask,
                old_logprobs=self.local[s].get("old_logprobs"),
                ref_logprobs=ref_lp.get(s),
                values=values.get(s),
            )
        device = self._device("actor")
        out, batch = experience.compute(inputs, algo, lambda t: all_reduce_sum(t, device))
        for_critic: dict[int, dict[str, torch.Tensor]] = {}
        mask_truncated = algo.shaping.mask_truncated
        masked = 0.0
        for s, adv in out.items():
            trained = inputs[s].valid
            if mask_truncated:  # rewardShaping.truncated Mask: in the group's baseline, not in the loss
                done = self.shards[s].finished or [True] * len(trained)
                finished = torch.tensor(done, dtype=torch.bool)
                masked += float((trained & ~finished).sum())
                trained = trained & finished
            self.local[s].update(advantages=adv.advantages, valid=trained, ref_logprobs=ref_lp.get(s))
            if adv.returns is not None:
                for_critic[s] = {"returns": adv.returns, "valid": trained}
        stats = {"kl_sum": batch.kl_sum, "kl_tokens": batch.kl_tokens, "valid": batch.valid,
                 "score_sum": batch.score_sum, "truncated_masked": masked,
                 "zero_advantage_groups": batch.zero_advantage_groups}  # fmt: skip
        if batch.score_moments is not None:  # global: the same on every rank
            m = batch.score_moments
            stats.update(score_count=m.count, score_mean=m.mean, score_m2=m.m2)
        if not self.reports:  # every rank of an SP group computed the same: count it once
            return {k: 0.0 for k in stats}, {}
        if batch.explained_variance is not None:  # global already: the same on every rank
            stats["explained_variance"] = batch.explained_variance
        return stats, for_critic

    def _device(self, role: str) -> torch.device:
        return torch.device(next(self.models[role].engine.parameters()).device)

    # ---- training phases ---------------------------------------------------------------------------
    def train_actor(self, algo: AlgorithmSettings) -> dict[str, float]:
        maybe_hang(algo.step, self.role, self.rank, self.world_size)  # tests only (fault_env)
        order = sorted(self.shards)
        r = self._combined()
        cat = {k: torch.cat([self.local[s][k] for s in order]) for k in ("advantages", "valid")}
        olds = [self.local[s].get("old_logprobs") for s in order]
        old = torch.cat(olds) if all(x is not None for x in olds) else None  # type: ignore[arg-type]
        refs = [self.local[s].get("ref_logprobs") for s in order]
        ref = torch.cat(refs) if all(x is not None for x in refs) else None  # type: ignore[arg-type]
        stats: dict[str, float] = self.models["actor"].train(
            r,
            old,
            cat["advantages"],
            ref,
            cat["valid"],
            micro_batch=algo.train_micro_batch,
            epochs=algo.epochs,
            mini_batches=algo.mini_batches,
            loss=PolicyLoss.from_settings(algo),
        )
        stats["trained_tokens"] = float(r.model_lens.sum()) * algo.epochs if self.reports else 0.0
        return stats

    def train_critic(self, returns_refs: list[Any], algo: AlgorithmSettings) -> dict[str, float]:
        import ray

        got: dict[int, dict[str, torch.Tensor]] = {}
        for part in ray.get(returns_refs):
            got.update(part)
        order = sorted(self.shards)
        r = self._combined()
        returns = torch.cat([got[s]["returns"] for s in order])
        valid = torch.cat([got[s]["valid"] for s in order])
        old_values = torch.cat([self.local[s]["values"] for s in order])
        result: dict[str, float] = self.models["critic"].train(
            r,
            old_values,
            returns,
            valid,
            micro_batch=algo.train_micro_batch,
            epochs=algo.epochs,
            clip=algo.value_clip,
            mini_batches=algo.mini_batches,
            aggregation=algo.loss_aggregation,
        )
        return result

    # ---- weight sync (actor ranks) ---------------------------------------------------------------------
    def weight_plan(self, bucket_bytes: int, wire_dtype: str | None = None) -> list[dict[str, Any]]:
        from rlhf_trainer.weight_sync.bucketing import dtype_from_name, plan_to_wire

        dtype = dtype_from_name(wire_dtype) if wire_dtype else None
        self.plan = self.models["actor"].weight_plan(bucket_bytes, dtype)
        return plan_to_wire(self.plan)

    def open_weight_channel(self, rdzv_wire: dict[str, Any] | None) -> None:
        """Join a (new) weight-sync group as its rank 0 (actor rank 0 only); None just closes the old one.
        The engines of a new channel hold nothing this rank sent: the delta sync starts from full."""
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        self.delta_sender = None
        if self.rank == 0 and rdzv_wire is not None:
            self.channel = open_channel(Rendezvous.from_wire(rdzv_wire), 0)

    def send_weights(self, delta_wire: dict[str, Any] | None = None) -> dict[str, Any]:
        """One sync. `delta_wire` (weightSync.delta on): {full_above, recheck_every, choose, verify, full}; `full`
        sends every bucket whole (the repair after a digest mismatch)."""
        from rlhf_trainer.weight_sync.delta import DeltaEncoder
        from rlhf_trainer.weight_sync.delta_wire import DeltaSender

        sender, verify = None, False
        if delta_wire is not None:
            verify = bool(delta_wire["verify"])
            if self.delta_sender is None:
                encoder = DeltaEncoder(
                    float(delta_wire["full_above"]),
                    int(delta_wire["recheck_every"]),
                    str(delta_wire["choose"]),
                )
                self.delta_sender = DeltaSender(encoder)
            if delta_wire.get("full"):
                self.delta_sender.reset()
            sender = self.delta_sender
        stats: dict[str, Any] = self.models["actor"].send_weights(self.plan, self.channel, sender, verify)
        stats["plan_bytes"] = float(plan_bytes(self.plan))
        return stats

    def gathered_state_dict(self) -> dict[str, torch.Tensor]:
        sd: dict[str, torch.Tensor] = self.models["actor"].gathered_state_dict()
        return sd

    # ---- checkpoint ---------------------------------------------------------------------------------
    def save(self, directory: str) -> list[str]:
        saved: list[str] = []
        for role in ("actor", "critic"):
            if role in self.models:
                self.models[role].save(directory, role)
                saved.append(role)
        return saved

    def load(self, directory: str) -> list[str]:
        loaded: list[str] = []
        for role in ("actor", "critic"):
            if role in self.models:
                self.models[role].load(directory, role)
                loaded.append(role)
        return loaded

    def state_digests(self) -> dict[str, dict[str, float]]:
        """{role: training-state digest} of the trained roles this rank hosts (resume checks)."""
        return {role: self.models[role].state_digest() for role in ("actor", "critic") if role in self.models}

    def node_id(self) -> str:
        """This process's Ray node (one per pod): same node means a shared /dev/shm."""
        import ray

        return str(ray.get_runtime_context().get_node_id())


def _merge_shard_dicts(parts: list[dict[int, torch.Tensor]]) -> dict[int, torch.Tensor]:
    out: dict[int, torch.Tensor] = {}
    for p in parts:
        out.update(p)
    return out
