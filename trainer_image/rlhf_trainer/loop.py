"""One PPO step as a sequence of named, timed phases (readable on one screen).

Owns the order of phases and what flows between them (object refs and small metadata only). How a
phase is done lives in the workers, the chunk dispatcher, the weight-sync manager and the checkpointer;
what was placed where in placement.py. Must not hold state across steps beyond `StepContext.history`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import ray
from rlhf_api.spec import RLHFJobSpec

from rlhf_trainer.checkpoint import Checkpointer
from rlhf_trainer.config import algorithm_wire, sampling
from rlhf_trainer.data import PromptDataset
from rlhf_trainer.faults import FaultInjector
from rlhf_trainer.metrics import PhaseTimer, TrainerExporter
from rlhf_trainer.placement import Placed, shards_of
from rlhf_trainer.rollout.dispatch import Chunk, ChunkDispatcher, Rollout
from rlhf_trainer.rollout.pool import EngineSlot
from rlhf_trainer.transfer import plan_chunks
from rlhf_trainer.weight_sync.manager import WeightSyncManager


class RewardFailure(RuntimeError):
    """Reward errors under onError=failStep: the step is abandoned before any training on it."""


@dataclass
class StepReport:
    step: int
    phase_seconds: dict[str, float]
    reward_mean: float
    kl: float
    generated_tokens: int
    trained_tokens: int
    reward_errors: int
    valid_samples: int
    tokens_per_second: float
    weight_sync_bytes: int = 0
    engines: list[int] = field(default_factory=list)
    checkpoint: str | None = None
    # policy_loss, clip_frac, first_ratio_deviation, optimizer_steps, rollout_logprob_gap; value_loss,
    # first_value_deviation and explained_variance with a critic (global figures; deviations are the
    # largest over ranks)
    training: dict[str, float] = field(default_factory=dict)
    rollout_digest: str = ""  # of every chunk's tokens, in chunk order


@dataclass
class StepContext:
    """What a step needs: the spec, the data, what was placed and the three helpers around it."""

    spec: RLHFJobSpec
    job: str
    data: PromptDataset
    placed: Placed
    sync: WeightSyncManager
    checkpointer: Checkpointer
    metrics: TrainerExporter
    faults: FaultInjector | None = None
    history: list[StepReport] = field(default_factory=list)


def run_step(ctx: StepContext, step: int) -> StepReport:
    spec, placed, faults = ctx.spec, ctx.placed, ctx.faults
    timer = PhaseTimer(ctx.metrics, on_start=(lambda p: faults.phase_started(step, p)) if faults else None)
    sync_bytes = ctx.sync.refresh(timer)  # elastic pool: new engines join (and get weights) between steps
    prompts, labels = ctx.data.next_batch(spec.algorithm.rollout_batch_size)
    chunks = plan_chunks(len(prompts), shards_of(spec), len(placed.pool.ready()))  # whole prompt groups
    placed.new_step()

    with timer.phase("generation"):  # rewards start as soon as each chunk is generated
        dispatcher = generate(ctx, step, chunks, prompts, labels)
    with timer.phase("reward"):  # only the part of scoring not hidden behind generation
        # A chunk whose engine was lost after finishing it is generated again here, so the engines sleep
        # (rollout.enableSleep, GPU: they free their memory while models train) only after it.
        rollout, reward_metas = dispatcher.scored()
    ctx.sync.engines_sleep(True)
    errors = sum(m.errors for m in reward_metas)
    ctx.metrics.reward_errors.labels(ctx.job).inc(errors)
    if errors and spec.model.reward.on_error == "failStep":
        first = next((msg for m in reward_metas for msg in m.messages), "")
        raise RewardFailure(f"step {step}: reward failed for {errors} sample(s) (onError=failStep): {first}")

    shards = by_shard(chunks, rollout.packed)  # {shard: [packed chunk refs]}; refs only
    rewards = by_shard(chunks, [result for _, result in rollout.reward_calls])
    micro, algo = spec.algorithm.rollout_micro_batch_size, algorithm_wire(spec)
    ref_out: list[Any] = []
    value_out: list[Any] = []
    if spec.algorithm.uses_reference and "reference" in placed.roles:
        with timer.phase("reference"):
            ref_out = placed.call_role("reference", "ref_logprobs", shards, micro)
    if placed.critic is not None:
        with timer.phase("critic_values"):
            value_out = placed.call_role("critic", "critic_values", shards, micro)
    if not algo["skip_old_logprobs"]:  # else the training pass's own log-probs (on-policy, ratio 1)
        with timer.phase("old_logprobs"):
            placed.call_role("actor", "old_logprobs", shards, micro)
    with timer.phase("advantages"):
        if algo["skip_old_logprobs"]:  # the actor ranks may not have pulled their shards yet
            placed.call_role("actor", "load_shards", shards, micro)
        adv = placed.actor.call("advantages", rewards, ref_out, value_out, algo, num_returns=2)
        stats = ray.get([s for s, _ in adv])
    valid = int(sum(s["valid"] for s in stats))
    trained_tokens = 0
    actor_stats: list[dict[str, float]] = []
    critic_stats: list[dict[str, float]] = []
    with timer.phase("actor_train"):
        if valid:
            actor_stats = placed.actor.get("train_actor", algo)
            trained_tokens = int(sum(s["trained_tokens"] for s in actor_stats))
    if placed.critic is not None:
        with timer.phase("critic_train"):
            if valid:
                critic_stats = placed.critic.get("train_critic", [r for _, r in adv], algo)
    with timer.phase("weight_sync"):
        ctx.sync.engines_sleep(False)
        sync_bytes += ctx.sync.sync() if valid else 0
    checkpoint = None
    if ctx.checkpointer.due(step):
        with timer.phase("checkpoint"):
            checkpoint = ctx.checkpointer.save(
                step, [asdict(r) for r in ctx.history], rollout_digest(rollout)
            )

    gen_tokens = sum(m.response_tokens for m in rollout.metas)
    kl_tokens = sum(s["kl_tokens"] for s in stats)
    kl = sum(s["kl_sum"] for s in stats) / max(kl_tokens, 1.0)
    if algo["skip_old_logprobs"] and actor_stats:  # no old log-probs: the training pass measured it
        kl = actor_stats[0]["kl"]
    report = StepReport(
        step=step,
        phase_seconds=dict(timer.seconds),
        reward_mean=sum(s["score_sum"] for s in stats) / max(valid, 1),
        kl=kl,
        generated_tokens=gen_tokens,
        trained_tokens=trained_tokens,
        reward_errors=errors,
        valid_samples=valid,
        tokens_per_second=gen_tokens / max(timer.seconds.get("generation", 0.0), 1e-9),
        weight_sync_bytes=sync_bytes,
        engines=sorted({m.engine for m in rollout.metas}),
        checkpoint=checkpoint,
        training=training_stats(stats, actor_stats, critic_stats),
        rollout_digest=rollout_digest(rollout),
    )
    record(ctx, report)
    return report


def generate(
    ctx: StepContext, step: int, chunks: list[Chunk], prompts: list[str], labels: list[Any]
) -> ChunkDispatcher:
    """The generation phase's work: stream the chunks out of the ready engines, scoring each at once.
    The dispatcher it returns gathers the scores (`scored`), regenerating what a lost engine held."""
    pool, metrics = ctx.placed.pool, ctx.metrics

    def engine_lost(slot: EngineSlot, err: BaseException) -> None:
        pool.mark_lost(slot, err)
        metrics.set_engines(pool.counts())

    dispatcher = ChunkDispatcher(step, pool.ready(), ctx.placed.reward, sampling(ctx.spec), engine_lost)
    rollout = dispatcher.run(chunks, prompts, labels)
    metrics.generated_tokens.labels(ctx.job).inc(sum(m.response_tokens for m in rollout.metas))
    return dispatcher


def training_stats(
    advantage_stats: list[dict[str, float]],
    actor: list[dict[str, float]],
    critic: list[dict[str, float]],
) -> dict[str, float]:
    """The step's training figures: every rank reports the global losses, so the first is taken; the
    first-micro-batch deviations are the largest over ranks."""
    out: dict[str, float] = {}
    if actor:
        keys = ("policy_loss", "clip_frac", "kl_loss", "optimizer_steps", "rollout_logprob_gap")
        out.update({k: actor[0][k] for k in keys})
        out["first_ratio_deviation"] = max(s["first_ratio_deviation"] for s in actor)
    if critic:
        out["value_loss"] = critic[0]["value_loss"]
        out["first_value_deviation"] = max(s["first_value_deviation"] for s in critic)
    ev = [s["explained_variance"] for s in advantage_stats if "explained_variance" in s]
    if ev:
        out["explained_variance"] = ev[0]
    return out


def rollout_digest(rollout: Rollout) -> str:
    """The step's rollout tokens as one short hash, from the engines' per-chunk digests (no tokens here)."""
    import hashlib

    joined = ",".join(m.digest for m in rollout.metas).encode()
    return hashlib.blake2b(joined, digest_size=8).hexdigest()


def by_shard(chunks: list[Chunk], refs: list[Any]) -> dict[int, list[Any]]:
    """{shard: [refs of its chunks]} in chunk order."""
    out: dict[int, list[Any]] = {}
    for (shard, _, _), ref in zip(chunks, refs, strict=True):
        out.setdefault(shard, []).append(ref)
    return out


def record(ctx: StepContext, report: StepReport) -> None:
    ctx.history.append(report)
    m = ctx.metrics
    m.reward_mean.labels(ctx.job).set(report.reward_mean)
    m.kl.labels(ctx.job).set(report.kl)
    if "explained_variance" in report.training:
        m.explained_variance.labels(ctx.job).set(report.training["explained_variance"])
    m.trained_tokens.labels(ctx.job).inc(report.trained_tokens)
    m.step_done(report.phase_seconds)
