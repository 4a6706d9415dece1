"""The Ray driver (job entrypoint): validates inputs, places the groups, runs the steps, serves /metrics.

Owns placement (model groups, engine pool, reward scorer), checkpoint/resume orchestration and the
per-step plumbing of object refs. Never touches token arrays: those move engine -> ranks by reference.
Run as `python -m rlhf_trainer.driver --job-name NAME --spec-env RLHF_SPEC_JSON` (the operator) or via
`rlhf run FILE` (cli.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rlhf_api.constants import ROLLOUT_RESOURCE, TRAINER_RESOURCE
from rlhf_api.rules import violated
from rlhf_api.spec import RLHFJobSpec
from rlhf_api.validate import runtime_issues, schema_issues, validate_manifest

from rlhf_trainer import device, faults
from rlhf_trainer.checkpoint import CheckpointStore
from rlhf_trainer.data import DatasetError, PromptDataset
from rlhf_trainer.phases import PhaseTimer, TrainerMetrics


class InputError(ValueError):
    """A bad input caught before any heavy work starts; the message names the field/path/function."""


# ---------------------------------------------------------------------------------------------- spec


def parse_spec(data: dict[str, Any]) -> RLHFJobSpec:
    """An RLHFJobSpec (or a whole RLHFJob manifest) -> RLHFJobSpec, validated like the API server does."""
    if "spec" in data and "kind" in data:
        issues = validate_manifest(data)
        if issues:
            raise InputError("spec fails validation:\n" + "\n".join(f"  {i}" for i in issues))
        return RLHFJobSpec.model_validate(data["spec"], by_alias=True, by_name=False)
    issues = schema_issues(RLHFJobSpec, data, ("spec",))
    if issues:
        raise InputError("spec fails validation:\n" + "\n".join(f"  {i}" for i in issues))
    spec = RLHFJobSpec.model_validate(data, by_alias=True, by_name=False)
    problems = violated(spec)
    if problems:
        raise InputError(
            "spec fails validation:\n" + "\n".join(f"  {r.field_path}: {r.message}" for r in problems)
        )
    return spec


def preflight(spec: RLHFJobSpec) -> PromptDataset:
    """Before Ray starts: the checks that need files (rlhf_api.validate.runtime_issues; the batch geometry
    is an admission rule), then the prompt dataset and the reward function, loaded with precise messages."""
    issues = runtime_issues(spec)
    if issues:
        raise InputError("\n".join(str(issue) for issue in issues))
    try:
        data = PromptDataset(spec.data.prompts, spec.data.input_key, spec.data.label_key, spec.algorithm.seed)
    except DatasetError as e:
        raise InputError(f"spec.{e}") from e
    if spec.model.reward.type == "function":
        from rlhf_trainer.workers.reward import RewardSetupError, load_reward_function

        try:
            load_reward_function(str(spec.model.reward.function))
        except RewardSetupError as e:
            raise InputError(f"spec.{e}") from e
    return data


def data_parallel_size(spec: Any, ranks: int) -> int:
    """Data-parallel groups of a model group with `ranks` ranks: each SP block is one (sees one shard)."""
    return int(ranks // spec.trainer.sequence_parallel_for(ranks))


# ---------------------------------------------------------------------------------------------- trainer


class Trainer:
    """Everything the loop needs, placed and ready. `run_step` in loop.py drives it."""

    def __init__(
        self,
        spec: Any,
        job: str,
        data: PromptDataset,
        metrics: TrainerMetrics,
        log: Callable[[str], None] = print,
    ) -> None:
        self.spec = spec
        self.job = job
        self.data = data
        self.metrics = metrics
        self.log = log
        self.algo = spec.algorithm
        self.info = device.detect()
        self.history: list[Any] = []
        self.checkpoints: list[str] = []
        self.resume_info: dict[str, Any] = {}
        self.store = CheckpointStore(spec.checkpoint.path) if spec.checkpoint.path else None
        self.actor_group: Any = None
        self.critic_group: Any = None
        self.role_groups: dict[str, Any] = {}
        self.groups: list[Any] = []
        self.pool: Any = None
        self.reward: Any = None
        self.sync_backend = device.resolve_weight_sync_backend(spec.weight_sync.backend, self.info)
        if spec.weight_sync.backend == "auto" and spec.trainer.colocate_all and not self.info.is_cpu:
            self.sync_backend = "cuda_ipc"
        self._channel_version = -1

    # ---- placement ----------------------------------------------------------------------------
    def _process_count(self) -> int:
        n = sum(p.ranks for roles, p in self.spec.gpu_groups() if set(roles) - {"reward"})
        return int(n + self.spec.rollout.engines + 1)

    def _resources(self, custom: str | None, gpus: float) -> Any:
        import ray

        from rlhf_trainer.groups import Resources

        resources = ray.cluster_resources()  # type: ignore[no-untyped-call]
        total_cpu = float(resources.get("CPU", 1.0))
        cpus = min(1.0, total_cpu / max(1, self._process_count()))
        have_custom = custom is not None and resources.get(custom, 0) > 0
        return Resources(cpus=cpus, gpus=gpus, custom={custom: 1.0} if have_custom and custom else {})

    def place(self) -> None:
        from rlhf_trainer.groups import RayGroup
        from rlhf_trainer.rollout.pool import EnginePool
        from rlhf_trainer.workers.rank import ModelRank
        from rlhf_trainer.workers.reward import RewardScorer

        spec = self.spec
        gpu = 0.0 if self.info.is_cpu else 1.0
        cores = os.cpu_count() or 1
        env = {"DS_ACCELERATOR": "cpu", "RLHF_DEVICE": "cpu"} if self.info.is_cpu else {}
        for roles, placement in spec.gpu_groups():
            hosted = [r for r in roles if r != "reward"]
            if not hosted:
                continue
            name = "+".join(hosted)
            res = self._resources(TRAINER_RESOURCE, gpu / sharers_per_device(spec, roles))
            threads = max(1, cores // placement.ranks)
            sp = spec.trainer.sequence_parallel_for(placement.ranks)
            group = RayGroup(
                name,
                ModelRank,
                placement.ranks,
                res,
                [
                    (name, hosted, r, placement.ranks, self.info.kind, threads, sp)
                    for r in range(placement.ranks)
                ],
                env=env,
            )
            self.groups.append(group)
            for role in hosted:
                self.role_groups[role] = group
            self.log(
                f"placed {name}: {placement.ranks} rank(s), {res.bundle()} per rank"
                + (f", sequence parallel {sp}" if sp > 1 else "")
            )
        self.actor_group = self.role_groups["actor"]
        self.critic_group = self.role_groups.get("critic")
        # Reward scorer: a threaded actor (function/http), or the holder of the reward model.
        reward_gpu = gpu / sharers_per_device(spec, ("reward",)) if spec.model.reward.type == "model" else 0.0
        self.reward = _remote(
            RewardScorer,
            self._resources(None, reward_gpu),
            max_concurrency=spec.model.reward.concurrency + 1,
            env=env,
        ).remote(spec.model.reward.model_dump(), self.info.kind)
        # Rollout engines.
        engine_gpu = float(spec.rollout.tensor_parallel_size) * gpu / sharers_per_device(spec, ("engine",))
        options = {
            "model_path": spec.model.actor,
            "device": self.info.kind,
            "seed": spec.algorithm.seed,
            "chat_template": spec.data.apply_chat_template,
            "max_model_len": spec.algorithm.max_prompt_length + spec.algorithm.max_response_length + 8,
            "tensor_parallel_size": spec.rollout.tensor_parallel_size,
            "gpu_memory_utilization": spec.rollout.gpu_memory_utilization,
            "enable_sleep": spec.rollout.enable_sleep,
            "threads": cores,
            "dtype": "bfloat16"
            if spec.trainer.bf16 and not self.info.is_cpu
            else ("float32" if self.info.is_cpu else "auto"),
        }
        self.pool = EnginePool(
            options, self._resources(ROLLOUT_RESOURCE, engine_gpu), spec.rollout.tensor_parallel_size
        )

    def _settings(self) -> dict[str, dict[str, Any]]:
        from transformers import AutoTokenizer

        spec, a = self.spec, self.algo
        tok = AutoTokenizer.from_pretrained(spec.model.actor)
        pad_id = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
        ranks = spec.trainer.actor.ranks
        base = {
            "zero_stage": spec.trainer.zero_stage,
            "bf16": bool(spec.trainer.bf16),
            "offload": spec.trainer.offload,
            "gradient_checkpointing": spec.trainer.gradient_checkpointing,
            "pad_id": int(pad_id),
            "lr_scheduler": a.lr_scheduler,
            "lr_warmup_steps": a.lr_warmup_steps * a.epochs,
            "total_steps": a.total_steps * a.epochs,
            "train_micro_batch": a.train_micro_batch_size,
            # log-probs of the distribution the engines sampled from (logits / T); greedy (T=0) -> 1
            "temperature": float(spec.rollout.temperature) if spec.rollout.temperature > 0 else 1.0,
        }

        def for_group(world: int) -> int:
            # every rank of an SP block runs all of its block's samples (its columns of each)
            local = a.samples_per_step // data_parallel_size(spec, world)
            return max(1, math.ceil(int(local) / int(a.train_micro_batch_size)))

        out = {
            "actor": {
                **base,
                "path": spec.model.actor,
                "lr": a.actor_learning_rate,
                "grad_accum": for_group(ranks),
            },
            "reference": {**base, "path": spec.model.reference_path, "lr": 0.0, "grad_accum": 1},
        }
        if spec.model.critic:
            world = spec.trainer.placement("critic").ranks
            out["critic"] = {
                **base,
                "path": spec.model.critic,
                "lr": a.critic_learning_rate,
                "grad_accum": for_group(world),
            }
        return out

    def setup(self) -> None:
        import ray

        t0 = time.perf_counter()
        self.pool.resize(self.pool.desired_from_cluster(self.spec.rollout.engines))
        settings = self._settings()
        setups = []
        for group in self.groups:
            addr, port = ray.get(group.handles[0].address.remote())
            setups += group.call("setup", addr, port, settings)
        ray.get(setups)
        ray.get(self.reward.ready.remote())
        self.pool.wait_ready()
        self.actor_group.get("weight_plan", self.spec.weight_sync.bucket_size_mib * 1024 * 1024)
        self.metrics.set_engines(self.pool.counts())
        self.log(f"groups ready in {time.perf_counter() - t0:.1f}s; engines: {self.pool.counts()}")

    # ---- per-step plumbing ---------------------------------------------------------------------
    def actors_and_models_new_step(self) -> None:
        import ray

        ray.get([ref for g in self.groups for ref in g.call("new_step")])

    def plan_chunks(self, n_prompts: int) -> list[tuple[int, int, list[int]]]:
        from rlhf_trainer.transfer import plan_chunks

        shards = data_parallel_size(self.spec, self.spec.trainer.actor.ranks)  # one per SP group
        return plan_chunks(n_prompts, shards, len(self.pool.ready()))

    def generate_and_score(
        self, step: int, chunks: list[tuple[int, int, list[int]]], prompts: list[str], labels: list[Any]
    ) -> tuple[list[Any], list[Any], list[tuple[Any, Any]]]:
        """Stream chunks out of the engines; each finished chunk goes to the reward scorer at once.

        Returns (packed refs, chunk metas, (reward meta ref, reward result ref)) in chunk order. Only the
        metadata is fetched here; the packed tokens stay in the object store.
        """
        import ray

        engines = self.pool.ready()
        sampling = {
            "n": self.algo.samples_per_prompt,
            "temperature": self.spec.rollout.temperature,
            "top_p": self.spec.rollout.top_p,
            "max_tokens": self.algo.max_response_length,
            "max_prompt_tokens": self.algo.max_prompt_length,
        }
        assigned: dict[int, list[dict[str, Any]]] = {}  # engine -> its chunks (re-dispatch reassigns)
        for c, (shard, engine, idx) in enumerate(chunks):
            assigned.setdefault(engine, []).append(
                {
                    "chunk": c,
                    "shard": shard,
                    "prompts": [prompts[i] for i in idx],
                    "groups": list(idx),
                    "labels": [labels[i] for i in idx],
                }
            )
        gens: dict[Any, tuple[int, list[dict[str, Any]]]] = {}  # stream -> (engine, its chunks)

        def launch(e: int, batch: list[dict[str, Any]]) -> None:
            gen = engines[e].handle.generate_chunks.options(num_returns="streaming").remote(batch, sampling)
            gens[gen] = (e, batch)

        for e, batch in assigned.items():
            launch(e, batch)
        packed: list[Any] = [None] * len(chunks)
        metas: list[Any] = [None] * len(chunks)
        reward_calls: list[Any] = [None] * len(chunks)
        lost: set[int] = set()

        def engine_lost(e: int, err: BaseException) -> None:
            for g in [g for g, (ge, _) in gens.items() if ge == e]:
                del gens[g]  # nothing more is read from a lost engine's streams
            if e not in lost:
                self._engine_lost(step, engines, e, err, lost, assigned, packed, metas, reward_calls, launch)

        engine_gone = (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError)
        gen: Any
        while gens:
            try:
                ready, _ = ray.wait(list(gens), num_returns=1)
            except engine_gone:
                # ray.wait itself raises when a stream's actor is unreachable: find which one(s).
                for gen in list(gens):
                    try:
                        ray.wait([gen], num_returns=1, timeout=0)
                    except engine_gone as err:
                        if gen in gens:
                            engine_lost(gens[gen][0], err)
                continue
            for gen in ready:
                if gen not in gens:
                    continue
                e, batch = gens[gen]
                try:
                    meta_ref = next(gen)
                    packed_ref = next(gen)
                    meta = ray.get(meta_ref)
                except StopIteration:
                    del gens[gen]
                    short = [b["chunk"] for b in batch if metas[b["chunk"]] is None]
                    if short:  # a stream that ends early: its actor died between two chunks
                        engine_lost(e, RuntimeError(f"its stream ended without chunks {short}"))
                    continue
                except engine_gone as err:
                    engine_lost(e, err)
                    continue
                packed[meta.chunk], metas[meta.chunk] = packed_ref, meta
                reward_calls[meta.chunk] = self.reward.score.options(num_returns=2).remote(
                    meta.chunk, packed_ref
                )
        missing = [c for c, m in enumerate(metas) if m is None]
        if missing:
            raise RuntimeError(f"step {step}: engines returned no rollout for chunks {missing}")
        self.metrics.generated_tokens.labels(self.job).inc(sum(m.response_tokens for m in metas))
        return packed, metas, reward_calls

    def _engine_lost(
        self,
        step: int,
        engines: list[Any],
        e: int,
        err: BaseException,
        lost: set[int],
        assigned: dict[int, list[dict[str, Any]]],
        packed: list[Any],
        metas: list[Any],
        reward_calls: list[Any],
        launch: Callable[[int, list[dict[str, Any]]], None],
    ) -> None:
        """An engine died mid-generation (its pod or node is gone): the step goes on with the others.

        Every chunk it had is generated again, including the finished ones: their tokens lived in the
        lost node's object store. With no engine left the step fails, and so does the attempt, which
        the operator restarts from the last checkpoint.
        """
        lost.add(e)
        self.pool.mark_lost(engines[e], err)
        self.metrics.set_engines(self.pool.counts())
        redo = assigned.pop(e, [])
        alive = [i for i in range(len(engines)) if i not in lost]
        if not alive:
            raise RuntimeError(
                f"step {step}: every rollout engine was lost (last: {type(err).__name__}: {err})"
            )
        for b in redo:
            packed[b["chunk"]] = metas[b["chunk"]] = reward_calls[b["chunk"]] = None
        moved: dict[int, list[dict[str, Any]]] = {}
        for k, b in enumerate(redo):
            moved.setdefault(alive[k % len(alive)], []).append(b)
        for target, batch in moved.items():
            assigned.setdefault(target, []).extend(batch)
            launch(target, batch)
        print(
            f"step {step}: rollout engine {engines[e].index} lost ({type(err).__name__}); "
            f"{len(redo)} chunk(s) generated again on engine(s) {sorted(engines[t].index for t in moved)}",
            file=sys.stderr,
            flush=True,
        )

    def shard_refs(self, chunks: list[tuple[int, int, list[int]]], refs: list[Any]) -> dict[int, list[Any]]:
        out: dict[int, list[Any]] = {}
        for (shard, _, _), ref in zip(chunks, refs, strict=True):
            out.setdefault(shard, []).append(ref)
        return out

    def has_role(self, role: str) -> bool:
        if role == "reference":
            return self.algo.uses_reference and role in self.role_groups
        return role in self.role_groups

    def call_role(self, role: str, method: str, shards: dict[int, list[Any]]) -> list[Any]:
        """Run an experience phase on the group hosting `role`. Its ranks form D data-parallel groups of
        SP ranks (contiguous blocks); rank w is in group w // SP and takes shards s with s % D == w // SP.
        Every rank of an SP group gets the same refs and pulls the chunks itself: nothing is broadcast."""
        import ray

        group = self.role_groups[role]
        W = group.world_size
        sp = self.spec.trainer.sequence_parallel_for(W)
        D = W // sp
        per_rank = [
            ({s: refs for s, refs in shards.items() if s % D == w // sp}, self.algo.rollout_micro_batch_size)
            for w in range(W)
        ]
        refs = group.call(method, per_rank=per_rank)
        ray.wait(refs, num_returns=len(refs))
        ray.get(refs)  # surface errors inside the phase that caused them
        return list(refs)

    def algo_wire(self) -> dict[str, Any]:
        a = self.algo
        return {
            "estimator": a.advantage_estimator,
            "kl_coef": a.kl_coef if a.uses_reference else 0.0,
            "gamma": a.gamma,
            "lam": a.lam,
            "clip": a.clip_range,
            "value_clip": a.value_clip_range,
            "epochs": a.epochs,
            "train_micro_batch": a.train_micro_batch_size,
        }

    # ---- engines and weight sync -----------------------------------------------------------------
    def engines_sleep(self, asleep: bool) -> None:
        """Put the engines to sleep / wake them (only with rollout.enableSleep; a no-op on CPU)."""
        import ray

        if self.spec.rollout.enable_sleep:
            ray.get([getattr(s.handle, "sleep" if asleep else "wake_up").remote() for s in self.pool.ready()])

    def refresh_engines(self, timer: PhaseTimer) -> int:
        """Between steps: follow the cluster's rollout slots, let engines that finished starting join.

        Engines start in the background (training goes on with the ready ones); a membership change
        rebuilds the sync group and sends the current weights, since a new engine loaded the files.
        Returns the bytes sent.
        """
        sent = 0
        self.pool.resize(self.pool.desired_from_cluster(self.spec.rollout.engines))
        self.pool.poll()
        if not self.pool.ready():
            self.pool.wait_ready()
        if self._channel_version != self.pool.membership_version:
            with timer.phase("weight_sync"):
                if self._channel_version >= 0 or self.resume_info:
                    sent = self.sync_weights()
                else:  # first step, fresh start: the engines loaded the actor's own files
                    self._open_channel()
        self.metrics.set_engines(self.pool.counts())
        return sent

    def _open_channel(self) -> None:
        import ray

        # The group's store is served by actor rank 0: its node and a port free there.
        rank0 = self.actor_group.handles[0]
        addr, port = ray.get(rank0.address.remote())
        backend = self.sync_backend
        if self.info.is_cpu and self.spec.weight_sync.backend == "auto":
            engine_nodes = [str(s.info.get("node_id", "")) for s in self.pool.ready()]
            backend = device.cpu_channel_for("auto", ray.get(rank0.node_id.remote()), engine_nodes)
            self.log(f"weight sync: auto -> {backend} for {len(engine_nodes)} engine(s)")
        rdzv = self.pool.rendezvous(backend, addr, port, self.job)
        refs = self.actor_group.call("open_weight_channel", rdzv.to_wire()) + self.pool.open_channel_refs(
            rdzv
        )
        ray.get(refs)
        self._channel_version = self.pool.membership_version

    def sync_weights(self) -> int:
        """Bucketed gather on every actor rank; rank 0 sends each bucket once to all engines."""
        import ray

        for slot in self.pool.prune_lost():
            self.log(f"rollout engine {slot.index} lost before the weight sync ({slot.info.get('error')})")
        if not self.pool.ready():
            raise RuntimeError("every rollout engine was lost before the weight sync")
        if self._channel_version != self.pool.membership_version:
            self._open_channel()
        plan = ray.get(
            self.actor_group.handles[0].weight_plan.remote(self.spec.weight_sync.bucket_size_mib << 20)
        )
        sends = self.actor_group.call("send_weights")
        recvs = self.pool.receive_refs(plan)
        send_stats = ray.get(sends)
        ray.get(recvs)
        sent = int(send_stats[0]["bytes"]) * max(1, len(recvs))
        self.metrics.weight_sync_bytes.labels(self.job).inc(sent)
        return sent

    # ---- checkpoints ------------------------------------------------------------------------------
    def checkpoint_due(self, step: int) -> bool:
        return self.store is not None and (
            step % self.spec.checkpoint.interval_steps == 0 or step == self.algo.total_steps
        )

    def save_checkpoint(self, step: int) -> str:
        import ray

        assert self.store is not None
        tmp = self.store.begin(step)
        try:
            ray.get([ref for g in self.groups for ref in g.call("save", str(tmp))])
            if faults.armed():
                faults.maybe_fire(self, step, "checkpoint", mid_write=True)
            state = {
                "data": self.data.position.to_dict(),
                "state_digests": self.state_digests(),
                "job": self.job,
                "history": [asdict(r) for r in self.history[-50:]],
                "time": time.time(),
            }
            final = self.store.commit(tmp, step, state)
        except BaseException:
            self.store.abort(tmp)
            raise
        self.store.rotate(self.spec.checkpoint.keep_last)
        self.checkpoints.append(str(final))
        return str(final)

    def state_digests(self) -> dict[str, dict[str, float]]:
        """{"<group>/<rank>/<role>": digest} of every trained model's weights, optimizer and schedule."""
        import ray

        out: dict[str, dict[str, float]] = {}
        for g in self.groups:
            for rank, digests in enumerate(ray.get(g.call("state_digests"))):
                for role, digest in digests.items():
                    out[f"{g.name}/{rank}/{role}"] = digest
        return out

    def resume_point(self) -> int:
        """The step of the checkpoint `maybe_resume` will load (0: a fresh start); reads no weights."""
        if self.store is None or self.spec.checkpoint.resume != "auto":
            return 0
        found = self.store.complete()
        return found[-1][0] if found else 0

    def maybe_resume(self) -> int:
        """Load the newest complete checkpoint (resume: auto); returns the next step to run."""
        import ray

        if self.store is None or self.spec.checkpoint.resume != "auto":
            return 1
        removed = self.store.remove_partial()
        for p in removed:
            self.log(f"removed partial checkpoint {p}")
        latest = self.store.latest()
        if latest is None:
            return 1
        step, path, state = latest
        ray.get([ref for g in self.groups for ref in g.call("load", str(path))])
        self.data.restore(state["data"])
        self.resume_info = {
            "from_step": step,
            "path": str(path),
            "data": state["data"],
            "state_digests_saved": state.get("state_digests"),
            "state_digests_loaded": self.state_digests(),
        }
        self.log(f"resumed from {path} (step {step}); data position {state['data']}")
        return step + 1

    def record(self, report: Any) -> None:
        self.history.append(report)
        m = self.metrics
        m.reward_mean.labels(self.job).set(report.reward_mean)
        m.kl.labels(self.job).set(report.kl)
        m.trained_tokens.labels(self.job).inc(report.trained_tokens)
        m.step_done(report.phase_seconds)

    def shutdown(self) -> None:
        import ray

        if self.actor_group is not None and self._channel_version >= 0:
            # close the sync channel first: the shm backend's buffer file is removed by its owner
            with contextlib.suppress(Exception):
                ray.get(self.actor_group.call("open_weight_channel", None), timeout=30)
        for g in self.groups:
            with contextlib.suppress(Exception):
                g.shutdown()
        if self.pool is not None:
            self.pool.shutdown()


def sharers_per_device(spec: Any, roles: tuple[str, ...]) -> int:
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


def _remote(cls: type, res: Any, max_concurrency: int = 1, env: dict[str, str] | None = None) -> Any:
    import ray

    return ray.remote(cls).options(  # type: ignore[attr-defined]
        num_cpus=res.cpus,
        num_gpus=res.gpus,
        resources=res.custom or None,
        max_concurrency=max_concurrency,
        runtime_env={"env_vars": env} if env else None,
    )


# ---------------------------------------------------------------------------------------------- ray


def connect_ray(processes: int) -> bool:
    """Connect to RAY_ADDRESS or a running local cluster, else start one; True if we started it."""
    import ray

    os.environ.setdefault("RAY_DEDUP_LOGS", "1")
    address = os.environ.get("RAY_ADDRESS", "")
    if address and address != "local":
        ray.init(address=address, log_to_driver=_log_workers())
        return False
    if not address:
        try:
            ray.init(address="auto", log_to_driver=_log_workers())
            return False
        except (ConnectionError, RuntimeError):
            pass
    cores = os.cpu_count() or 1
    ray.init(
        address="local",
        num_cpus=max(cores, processes),
        include_dashboard=False,
        log_to_driver=_log_workers(),
        runtime_env={"env_vars": {"RLHF_DEVICE": os.environ.get("RLHF_DEVICE", "")}}
        if os.environ.get("RLHF_DEVICE")
        else None,
    )
    return True


def _log_workers() -> bool:
    return os.environ.get("RLHF_WORKER_LOGS", "1") != "0"


def run(
    spec: Any,
    job: str,
    *,
    steps: int | None = None,
    metrics_port: int | None = None,
    on_step: Callable[[Any], None] | None = None,
    log: Callable[[str], None] = print,
    data: PromptDataset | None = None,
) -> dict[str, Any]:
    """Run the job's steps; returns the summary. Raises InputError / RewardFailure / RuntimeError."""
    import ray

    from rlhf_trainer.loop import run_step

    data = data or preflight(spec)
    metrics = TrainerMetrics(job)
    metrics.driver_started()  # the stall clock runs from here until the first step completes
    metrics.total_steps.labels(job).set(spec.algorithm.total_steps)
    metrics.stall_timeout.labels(job).set(spec.monitoring.stall_timeout_seconds)
    port = (
        metrics_port
        if metrics_port is not None
        else int(os.environ.get("RLHF_METRICS_PORT") or spec.monitoring.metrics_port)
    )
    trainer = Trainer(spec, job, data, metrics, log)
    # Before /metrics is served: a restarted attempt reports the step it will resume from, not 0, for
    # the minute its start-up takes (`kubectl get rlhf` never shows 0/N mid-run).
    announced = trainer.resume_point()
    metrics.resumed(announced)
    if port:
        metrics.serve(port)
        log(f"metrics on :{port}/metrics")
    started = connect_ray(trainer._process_count() + 1)
    try:
        trainer.place()
        trainer.setup()
        first = trainer.maybe_resume()
        metrics.resumed(first - 1 - announced)  # the counter continues from the checkpoint's step
        last = (
            spec.algorithm.total_steps
            if steps is None
            else min(spec.algorithm.total_steps, first + steps - 1)
        )
        summary: dict[str, Any] = {
            "job": job,
            "steps": [],
            "checkpoints": trainer.checkpoints,
            "resumed_from": trainer.resume_info.get("from_step"),
            "resume": trainer.resume_info,
            "engines": [s.info for s in trainer.pool.ready()],
        }
        for step in range(first, last + 1):
            report = run_step(trainer, step)
            summary["steps"].append(
                {
                    "step": report.step,
                    "reward_mean": report.reward_mean,
                    "kl": report.kl,
                    "phase_seconds": report.phase_seconds,
                    "tokens_per_second": report.tokens_per_second,
                    "generated_tokens": report.generated_tokens,
                    "trained_tokens": report.trained_tokens,
                    "reward_errors": report.reward_errors,
                    "valid_samples": report.valid_samples,
                    "weight_sync_bytes": report.weight_sync_bytes,
                    "checkpoint": report.checkpoint,
                    "engines": report.engines,
                }
            )
            if on_step is not None:
                on_step(report)
        summary["data_position"] = data.position.to_dict()
        return summary
    finally:
        trainer.shutdown()
        if started:
            ray.shutdown()


# ---------------------------------------------------------------------------------------------- main


def load_spec_arg(args: argparse.Namespace) -> Any:
    if args.spec_json:
        raw = args.spec_json
    elif args.spec_env:
        raw = os.environ.get(args.spec_env, "")
        if not raw:
            raise InputError(f"--spec-env {args.spec_env}: environment variable is empty or unset")
    elif args.spec_file:
        import yaml

        try:
            return parse_spec(yaml.safe_load(Path(args.spec_file).read_text()))
        except OSError as e:
            raise InputError(f"--spec-file {args.spec_file}: cannot read: {e.strerror or e}") from e
    else:
        raise InputError("one of --spec-json, --spec-env, --spec-file is required")
    try:
        return parse_spec(json.loads(raw))
    except json.JSONDecodeError as e:
        raise InputError(f"spec JSON is malformed: {e}") from e


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rlhf_trainer.driver", description=__doc__)
    p.add_argument("--job-name", default=os.environ.get("RLHF_JOB_NAME", "local"))
    p.add_argument("--spec-json")
    p.add_argument("--spec-env")
    p.add_argument("--spec-file")
    p.add_argument("--steps", type=int)
    p.add_argument("--summary-json")
    args = p.parse_args(argv)
    try:
        spec = load_spec_arg(args)
        summary = run(
            spec,
            args.job_name,
            steps=args.steps,
            on_step=lambda r: print(
                json.dumps(
                    {
                        "step": r.step,
                        "reward_mean": round(r.reward_mean, 4),
                        "phase_seconds": {k: round(v, 3) for k, v in r.phase_seconds.items()},
                        "engines": r.engines,
                    }
                ),
                flush=True,
            ),
        )
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        # Not a bad input: the trace says where (the job's log is where an operator will look).
        traceback.print_exc(file=sys.stderr)
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    if args.summary_json:
        Path(args.summary_json).write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
