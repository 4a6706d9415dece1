"""One PPO step as a sequence of named, timed phases (readable on one screen).

Owns the order of phases and what flows between them (object refs and small metadata only). How a
phase is done lives in the workers, the engine pool and the weight-sync backends; placement in driver.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import ray

from rlhf_trainer.faults import armed, maybe_fire
from rlhf_trainer.phases import PhaseTimer

if TYPE_CHECKING:
    from rlhf_trainer.driver import Trainer


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
    extra: dict[str, Any] = field(default_factory=dict)


def run_step(t: Trainer, step: int) -> StepReport:
    timer = PhaseTimer(t.metrics, on_start=(lambda phase: maybe_fire(t, step, phase)) if armed() else None)
    sync_bytes = t.refresh_engines(timer)  # elastic pool: new engines join (and get weights) between steps
    prompts, labels = t.data.next_batch(t.algo.rollout_batch_size)
    chunks = t.plan_chunks(len(prompts))  # [(shard, engine, [prompt indices])], whole prompt groups
    t.actors_and_models_new_step()

    with timer.phase("generation"):  # rewards start as soon as each chunk is generated
        packed, metas, reward_calls = t.generate_and_score(step, chunks, prompts, labels)
        t.engines_sleep(True)  # rollout.enableSleep (GPU): engines free their memory while models train
    with timer.phase("reward"):  # only the part of scoring not hidden behind generation
        reward_metas = ray.get([meta_ref for meta_ref, _ in reward_calls])
    errors = sum(m.errors for m in reward_metas)
    t.metrics.reward_errors.labels(t.job).inc(errors)
    if errors and t.spec.model.reward.on_error == "failStep":
        first = next((msg for m in reward_metas for msg in m.messages), "")
        raise RewardFailure(f"step {step}: reward failed for {errors} sample(s) (onError=failStep): {first}")

    shards = t.shard_refs(chunks, packed)  # {shard: [packed chunk refs]}; refs only
    rewards = t.shard_refs(chunks, [result for _, result in reward_calls])
    ref_out: list[Any] = []
    value_out: list[Any] = []
    if t.has_role("reference"):
        with timer.phase("reference"):
            ref_out = t.call_role("reference", "ref_logprobs", shards)
    if t.has_role("critic"):
        with timer.phase("critic_values"):
            value_out = t.call_role("critic", "critic_values", shards)
    with timer.phase("old_logprobs"):
        t.call_role("actor", "old_logprobs", shards)
    with timer.phase("advantages"):
        adv = t.actor_group.call("advantages", rewards, ref_out, value_out, t.algo_wire(), num_returns=2)
        stats = ray.get([s for s, _ in adv])
    valid = int(sum(s["valid"] for s in stats))
    trained_tokens = 0
    with timer.phase("actor_train"):
        if valid:
            train_stats = t.actor_group.get("train_actor", t.algo_wire())
            trained_tokens = int(sum(s["trained_tokens"] for s in train_stats))
    if t.critic_group is not None:
        with timer.phase("critic_train"):
            if valid:
                t.critic_group.get("train_critic", [r for _, r in adv], t.algo_wire())
    with timer.phase("weight_sync"):
        t.engines_sleep(False)
        sync_bytes += t.sync_weights() if valid else 0
    checkpoint = None
    if t.checkpoint_due(step):
        with timer.phase("checkpoint"):
            checkpoint = t.save_checkpoint(step)

    gen_tokens = sum(m.response_tokens for m in metas)
    kl_tokens = sum(s["kl_tokens"] for s in stats)
    report = StepReport(
        step=step,
        phase_seconds=dict(timer.seconds),
        reward_mean=sum(s["score_sum"] for s in stats) / max(valid, 1),
        kl=sum(s["kl_sum"] for s in stats) / max(kl_tokens, 1.0),
        generated_tokens=gen_tokens,
        trained_tokens=trained_tokens,
        reward_errors=errors,
        valid_samples=valid,
        tokens_per_second=gen_tokens / max(timer.seconds.get("generation", 0.0), 1e-9),
        weight_sync_bytes=sync_bytes,
        engines=sorted({m.engine for m in metas}),
        checkpoint=checkpoint,
    )
    t.record(report)
    return report
