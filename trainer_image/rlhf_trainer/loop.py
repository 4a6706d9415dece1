"""One PPO step as a sequence of named, timed phases (readable on one screen).

Owns the order of phases and what flows between them (object refs and small metadata only), in both
modes: synchronous (generate, score, train, sync) and asynchronous (algorithm.async: the batch of step
n+1 is generated in the background while step n trains; pipeline.py decides staleness and idle ratios).
How a phase is done lives in the workers, the chunk dispatcher, the weight-sync manager and the
checkpointer; what was placed where in placement.py. State across steps: `StepContext.history`, the
weight versions and the one batch generated ahead.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any

import ray
from rlhf_api.spec import RLHFJobSpec

from rlhf_trainer import dynamic_sampling as dynamic
from rlhf_trainer.agents.episodes import merge_stats
from rlhf_trainer.algorithms import AdaptiveKL
from rlhf_trainer.checkpoint import Checkpointer
from rlhf_trainer.config import algorithm_wire, eval_sampling, sampling
from rlhf_trainer.data import PromptBatch, PromptDataset
from rlhf_trainer.evaluation import evaluate
from rlhf_trainer.faults import FaultInjector
from rlhf_trainer.groups import RayGroup
from rlhf_trainer.metrics import PhaseTimer, TrainerExporter
from rlhf_trainer.overlap import PhaseWork, run_phases
from rlhf_trainer.pipeline import Background, admit, busy_seconds, idle_ratio, staleness
from rlhf_trainer.placement import Placed, shards_of
from rlhf_trainer.rollout.dispatch import AgentChunkDispatcher, Chunk, ChunkDispatcher, Rollout
from rlhf_trainer.rollout.pool import EngineSlot
from rlhf_trainer.stacks.watchdog import PhaseWatchdog
from rlhf_trainer.transfer import ChunkMeta, balance_shards, plan_chunks
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
    staleness: int = 0  # optimizer steps between the generating weights and the trained policy
    stale_samples: int = 0  # samples of a too-stale batch regenerated or dropped before this step trained
    step_seconds: float = 0.0  # wall time, start to end (phases that overlap count once)
    trainer_idle_ratio: float = 0.0  # share of the step the trainer waited for rollouts
    rollout_idle_ratio: float = 0.0  # share of the step the engines were not generating
    generating_seconds: float = 0.0  # how long the engines took to generate the batch (async: partly hidden)
    # algorithm.dynamicSampling: extra rounds, groups trained whose rewards differ, equal-reward groups
    # dropped, equal-reward groups trained because the rounds ran out (short), and the first round's
    # mean reward (generated_reward_mean)
    dynamic_sampling: dict[str, float] = field(default_factory=dict)
    # weightSync.delta: buckets by encoding, elements compared and changed, bytes sent and in full,
    # digest checks, mismatches found and full repairs (empty without delta sync)
    weight_sync: dict[str, float] = field(default_factory=dict)
    # the evaluation split after this step (spec.evaluation; empty when none was due): reward_mean,
    # by_data_source, prompts, samples, valid_samples, reward_errors, weights_behind (evaluation.EvalTally).
    # None of its samples is in the figures above.
    evaluation: dict[str, Any] = field(default_factory=dict)
    # rollout.agent: the trained batch's episodes (agents.episodes.episode_stats over every round):
    # episodes, turns_mean, turns_max, tool_calls, tool_errors, tool_seconds, model_tokens, tool_tokens and
    # end_<reason> counts. Empty without agents.
    agent: dict[str, float] = field(default_factory=dict)


@dataclass
class ObjectiveState:
    """What the objective carries from step to step (checkpointed, so a resumed run goes on with it): the
    adaptive KL coefficient and the running moments of the scores (rewardShaping.normalize)."""

    kl_coef: float
    score_moments: dict[str, float] | None = None

    @staticmethod
    def restore(spec: RLHFJobSpec, saved: dict[str, Any] | None) -> ObjectiveState:
        a = spec.algorithm
        state = ObjectiveState(a.kl_coef if a.uses_reference else 0.0)
        if saved:
            state.kl_coef = float(saved.get("kl_coef", state.kl_coef))
            state.score_moments = saved.get("score_moments")
        return state


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
    watchdog: PhaseWatchdog | None = None  # the driver's own hang watch (stacks.watchdog)
    history: list[StepReport] = field(default_factory=list)
    last_step: int = 0  # the run's last step (0: algorithm.totalSteps): no batch is generated beyond it
    actor_version: int = 0  # optimizer updates of the actor this run (weight versions count from its start)
    engine_version: int = 0  # the actor version the engines hold
    ahead: Pending | None = None  # async: the next step's batch, generating while this one trains
    generating: list[tuple[float, float]] = field(default_factory=list)  # when the engines were busy
    objective: ObjectiveState | None = None  # set by the driver after resuming (ObjectiveState.restore)


@dataclass
class Generated:
    """A step's batch, generated and scored: what training reads, and where it came from."""

    step: int
    chunks: list[Chunk]
    rollout: Rollout
    reward_metas: list[Any]
    version: int  # the actor version the engines held when it was launched
    position: dict[str, Any]  # the data position after its prompts were drawn
    prompts: PromptBatch  # what was drawn: a regeneration asks for the same
    generating_seconds: float  # how long the engines took to generate it
    generated_tokens: int | None = None  # every round's (dynamic sampling); None: the rollout's
    engines: list[int] | None = None  # the engines every round used (dynamic sampling); None: the rollout's
    dynamic_sampling: dict[str, float] = field(default_factory=dict)
    agent: dict[str, float] = field(default_factory=dict)  # rollout.agent: every round's episodes' figures


@dataclass
class Pending:
    """A batch generating in the background (async): set `generated` when the engines are done with it,
    then its scores finish; `work.result()` is the `Generated`."""

    step: int
    work: Background[Generated]
    generated: threading.Event
    interval: list[float]  # [launched, generated] (monotonic; one item while it generates)


def run_step(ctx: StepContext, step: int) -> StepReport:
    """One step: synchronous, or with algorithm.async the batch generated ahead during the last step."""
    spec, faults, watch = ctx.spec, ctx.faults, ctx.watchdog

    def on_start(phase: str) -> None:
        if watch is not None:
            watch.started(phase, step)
        if faults is not None:
            faults.phase_started(step, phase)

    timer = PhaseTimer(ctx.metrics, on_start=on_start, on_stop=watch.ended if watch else None)
    started = time.monotonic()
    if spec.algorithm.async_.enabled:
        gen, sync_bytes, stale, dropped = next_async_batch(ctx, step, timer)
    else:
        sync_bytes = ctx.sync.refresh(timer)  # elastic pool: new engines join (and get weights) between steps
        gen, stale, dropped = generate_now(ctx, step, timer), 0, 0
    report = train_on(ctx, step, gen, timer, sync_bytes, started)
    report.staleness, report.stale_samples = stale, dropped
    if eval_due(ctx, step):  # after training: its time is the step's, its samples are not
        run_eval(ctx, step, timer, report)
        report.phase_seconds = dict(timer.seconds)
        report.step_seconds = time.monotonic() - started
    ctx.metrics.sample_staleness.labels(ctx.job).observe(stale)  # per batch: its samples share a version
    record(ctx, report)
    return report


def eval_due(ctx: StepContext, step: int) -> bool:
    """Whether the evaluation split runs after `step` (evaluation.everySteps, or the last step with atEnd)."""
    plan = ctx.spec.evaluation_plan()
    return (
        plan is not None
        and ctx.data.eval_split is not None
        and plan.due(step, ctx.spec.algorithm.total_steps)
    )


def run_eval(ctx: StepContext, step: int, timer: PhaseTimer, report: StepReport) -> None:
    """The `eval` phase: the evaluation split on the engines with the weights just trained (synchronous),
    or, asynchronous, those that generate the next batch while it trains (one step behind; the last step
    syncs first, nothing generating). Its figures go to the report's `evaluation` and to /metrics only."""
    split = ctx.data.eval_split
    assert split is not None
    pool, metrics = ctx.placed.pool, ctx.metrics
    if ctx.ahead is None and ctx.engine_version < ctx.actor_version:  # async's last step: engines idle
        with timer.phase("weight_sync"):
            report.weight_sync_bytes += ctx.sync.sync()
        ctx.engine_version = ctx.actor_version

    def engine_lost(slot: EngineSlot, err: BaseException) -> None:
        pool.mark_lost(slot, err)
        metrics.set_engines(pool.counts())

    def dispatcher(engines: list[EngineSlot]) -> ChunkDispatcher:  # rollout.agent: the agent's episodes
        return new_dispatcher(ctx, step, engines, eval_sampling(ctx.spec), engine_lost, timer)

    with timer.phase("eval"):
        tally = evaluate(
            split, pool, ctx.placed.reward, eval_sampling(ctx.spec), step, engine_lost, dispatcher=dispatcher
        )
    metrics.evaluated(step, tally.reward_mean, tally.by_source(), tally.errors)
    report.evaluation = tally.report(step, ctx.actor_version - ctx.engine_version)


def generate_now(
    ctx: StepContext, step: int, timer: PhaseTimer, batch: PromptBatch | None = None
) -> Generated:
    """Generate and score a batch on the critical path (the synchronous step, and the first async one)."""
    ctx.placed.new_step()
    gen = generate_round(ctx, step, timer, batch)
    if ctx.spec.algorithm.dynamic_sampling.enabled:
        gen = refill(ctx, step, timer, gen)
    return gen


def generate_round(
    ctx: StepContext, step: int, timer: PhaseTimer, batch: PromptBatch | None = None
) -> Generated:
    """One batch of rolloutBatchSize prompts generated and scored on the critical path."""
    batch = batch or ctx.data.next_batch(ctx.spec.algorithm.rollout_batch_size)
    position = ctx.data.position.to_dict()
    # whole groups
    chunks = plan_chunks(len(batch.prompts), shards_of(ctx.spec), len(ctx.placed.pool.ready()))
    t0 = time.monotonic()
    with timer.phase("generation"):  # rewards start as soon as each chunk is generated
        dispatcher = generate(ctx, step, chunks, batch, timer)
    t1 = time.monotonic()
    ctx.generating.append((t0, t1))
    with timer.phase("reward"):  # only the part of scoring not hidden behind generation
        # A chunk whose engine was lost after finishing it is generated again here, so the engines sleep
        # (rollout.enableSleep, GPU: they free their memory while models train) only after it.
        rollout, reward_metas = dispatcher.scored()
    return Generated(
        step, chunks, rollout, reward_metas, ctx.engine_version, position, batch, t1 - t0,
        agent=merge_stats([m.agent for m in rollout.metas]),
    )  # fmt: skip


def refill(ctx: StepContext, step: int, timer: PhaseTimer, first: Generated) -> Generated:
    """DAPO's dynamic sampling: generate further rounds until rolloutBatchSize groups have rewards that
    differ (at most dynamicSampling.maxExtraRounds), then compose the step's chunks from those groups."""
    a = ctx.spec.algorithm
    n, batch = a.samples_per_prompt, a.rollout_batch_size
    rounds = [first]
    flags = [round_flags(first, n)]
    while dynamic.informative_count(flags) < batch and len(rounds) <= a.dynamic_sampling.max_extra_rounds:
        rounds.append(generate_round(ctx, step, timer))
        flags.append(round_flags(rounds[-1], n))
    picked = dynamic.pick(flags, batch)
    first_valid = sum(m.samples - m.errors for m in first.reward_metas)
    stats = {"rounds": len(rounds) - 1, "informative": picked.informative, "dropped": picked.dropped,
             "short": picked.short,
             # the first round's mean reward: the policy's own, before the filter picks groups (the
             # step's reward_mean is of the trained groups, which the filter biases toward mixed ones)
             "generated_reward_mean": sum(m.score_sum for m in first.reward_metas) / max(first_valid, 1)}  # fmt: skip
    ctx.metrics.dynamic_sampling_rounds.labels(ctx.job).inc(len(rounds) - 1)
    ctx.metrics.dynamic_sampling_groups.labels(ctx.job, "dropped").inc(picked.dropped)
    ctx.metrics.dynamic_sampling_groups.labels(ctx.job, "short").inc(picked.short)
    with timer.phase("reward"):  # composing is part of getting the step's scored batch
        chunks = plan_chunks(batch, shards_of(ctx.spec), len(ctx.placed.pool.ready()))
        task: Any = ray.remote(dynamic.compose).options(num_cpus=0, num_returns=3)  # type: ignore[attr-defined]
        refs = []
        for c, (shard, _, idx) in enumerate(chunks):
            parts: list[tuple[Any, Any, list[int]]] = []
            for g in (picked.groups[i] for i in idx):
                src = rounds[g.round].rollout
                if parts and parts[-1][0] is src.packed[g.chunk]:
                    parts[-1][2].append(g.group)
                else:
                    parts.append((src.packed[g.chunk], src.reward_calls[g.chunk][1], [g.group]))
            head = picked.groups[idx[0]]  # the composed chunk is reported as its first group's engine's
            engine = rounds[head.round].rollout.metas[head.chunk].engine
            refs.append(task.remote(c, shard, engine, idx[0], n, parts))
        metas = ray.get([m for _, _, m in refs])
    rollout = Rollout([p for p, _, _ in refs], metas, [(None, r) for _, r, _ in refs])
    return Generated(
        step=step,
        chunks=chunks,
        rollout=rollout,
        reward_metas=[m for g in rounds for m in g.reward_metas],
        version=first.version,
        position=rounds[-1].position,
        prompts=first.prompts,
        generating_seconds=sum(g.generating_seconds for g in rounds),
        generated_tokens=sum(m.generated_tokens for g in rounds for m in g.rollout.metas),
        engines=sorted({m.engine for g in rounds for m in g.rollout.metas}),
        dynamic_sampling=stats,
        agent=merge_stats([g.agent for g in rounds]),
    )


def round_flags(gen: Generated, n: int) -> list[list[bool]]:
    """Per chunk of a round, per group: whether its rewards differ (the scores only, fetched here)."""
    results = ray.get([result for _, result in gen.rollout.reward_calls])
    return [dynamic.chunk_groups(r, n) for r in results]


def next_async_batch(ctx: StepContext, step: int, timer: PhaseTimer) -> tuple[Generated, int, int, int]:
    """Async: wait for this step's batch (generated during the last step), bring the engines to the
    actor's weights while they are idle, admit the batch (or regenerate / drop one too stale), and launch
    the next step's batch. Returns (batch, bytes synced, its staleness, stale samples put aside)."""
    spec = ctx.spec.algorithm.async_
    pending, ctx.ahead = ctx.ahead, None
    if pending is None or pending.step != step:  # the first step of a run: nothing was generated ahead
        sync_bytes = refresh(ctx, timer)
        gen = generate_now(ctx, step, timer)
    else:
        gen = wait(pending, timer)
        ctx.generating.append(pending_interval(pending, time.monotonic()))
        sync_bytes = refresh(ctx, timer)  # the engines are idle: membership changes, weights for new ones
    if ctx.engine_version < ctx.actor_version:  # after each optimizer step, between the engines' requests
        with timer.phase("weight_sync"):
            sync_bytes += ctx.sync.sync()
        ctx.engine_version = ctx.actor_version
    stale, put_aside = staleness(ctx.actor_version, gen.version), 0
    action = admit(stale, spec.max_staleness, spec.stale_samples)
    if action != "train":
        samples = sum(m.samples for m in gen.rollout.metas)
        label = "regenerated" if action == "Regenerate" else "dropped"
        ctx.metrics.stale_samples.labels(ctx.job, label).inc(samples)
        print(
            f"step {step}: batch generated by weights {stale} step(s) old (algorithm.async.maxStaleness "
            f"{spec.max_staleness}): {samples} samples {label}",
            flush=True,
        )
        gen = generate_now(ctx, step, timer, gen.prompts if action == "Regenerate" else None)
        stale, put_aside = staleness(ctx.actor_version, gen.version), samples
    ctx.placed.new_step()  # the ranks drop the last step's shards before this one's experience
    last = ctx.last_step or ctx.spec.algorithm.total_steps
    if step < last:
        ctx.ahead = launch(ctx, step + 1)  # generates while this step trains
    return gen, sync_bytes, stale, put_aside


def refresh(ctx: StepContext, timer: PhaseTimer) -> int:
    """The pool's membership between batches (new engines get the actor's weights); returns bytes sent."""
    sent = ctx.sync.refresh(timer)
    if sent:
        ctx.engine_version = ctx.actor_version
    return sent


def launch(ctx: StepContext, step: int) -> Pending:
    """Start generating (and scoring) step's batch in the background with the weights the engines hold."""
    batch = ctx.data.next_batch(ctx.spec.algorithm.rollout_batch_size)
    position = ctx.data.position.to_dict()
    chunks = plan_chunks(len(batch.prompts), shards_of(ctx.spec), len(ctx.placed.pool.ready()))
    version, done, interval = ctx.engine_version, threading.Event(), [time.monotonic()]

    def work() -> Generated:
        try:  # its own timer: the step training meanwhile times its phases (a tool's shows in /metrics)
            dispatcher = generate(ctx, step, chunks, batch, PhaseTimer(ctx.metrics))
        finally:
            interval.append(time.monotonic())
            done.set()
        rollout, reward_metas = dispatcher.scored()
        seconds = interval[1] - interval[0]
        agent = merge_stats([m.agent for m in rollout.metas])
        return Generated(step, chunks, rollout, reward_metas, version, position, batch, seconds, agent=agent)

    return Pending(step, Background(work, name=f"rollout-step-{step}"), done, interval)


def wait(pending: Pending, timer: PhaseTimer) -> Generated:
    """The critical-path part of a batch generated ahead: the generation and scoring still running."""
    with timer.phase("generation"):
        pending.generated.wait()
    with timer.phase("reward"):
        gen = pending.work.result()
    return gen


def abandon(ctx: StepContext) -> None:
    """The run ends before the batch generated ahead is trained (a stop): nothing waits for it."""
    if ctx.ahead is not None:
        ctx.ahead.work.cancel()
        ctx.ahead = None


def train_on(
    ctx: StepContext, step: int, gen: Generated, timer: PhaseTimer, sync_bytes: int, started: float
) -> StepReport:
    """Experience, training, weight sync (synchronous mode) and checkpoint on a generated batch."""
    spec, placed = ctx.spec, ctx.placed
    chunks, rollout, reward_metas = gen.chunks, gen.rollout, gen.reward_metas
    asynchronous = spec.algorithm.async_.enabled
    if not asynchronous:
        ctx.sync.engines_sleep(True)
    errors = sum(m.errors for m in reward_metas)
    ctx.metrics.reward_errors.labels(ctx.job).inc(errors)
    if errors and spec.model.reward.on_error == "failStep":
        first = next((msg for m in reward_metas for msg in m.messages), "")
        raise RewardFailure(f"step {step}: reward failed for {errors} sample(s) (onError=failStep): {first}")

    chunks = balanced(chunks, rollout.metas)  # chunks to ranks by tokens, each rank's sample count kept
    shards = by_shard(chunks, rollout.packed)  # {shard: [packed chunk refs]}; refs only
    rewards = by_shard(chunks, [result for _, result in rollout.reward_calls])
    micro, algo = spec.algorithm.rollout_micro_batch_size, algorithm_wire(spec)
    if ctx.objective is None:  # a context built without the driver's restore: a fresh run's state
        ctx.objective = ObjectiveState.restore(spec, None)
    objective = ctx.objective
    algo["kl_coef"], algo["score_moments"] = objective.kl_coef, objective.score_moments

    def forward(phase: str, role: str, method: str) -> PhaseWork:
        return PhaseWork(phase, placed.roles[role], partial(placed.launch_role, role, method, shards, micro))

    forwards = []  # run at once where different groups host them (overlap.py)
    if spec.algorithm.uses_reference and "reference" in placed.roles:
        forwards.append(forward("reference", "reference", "ref_logprobs"))
    if placed.critic is not None:
        forwards.append(forward("critic_values", "critic", "critic_values"))
    if not algo["skip_old_logprobs"]:  # else the training pass's own log-probs (on-policy, ratio 1)
        forwards.append(forward("old_logprobs", "actor", "old_logprobs"))
    experience = run_phases(timer, forwards)
    ref_out, value_out = experience.get("reference", []), experience.get("critic_values", [])
    with timer.phase("advantages"):
        if algo["skip_old_logprobs"]:  # the actor ranks may not have pulled their shards yet
            placed.call_role("actor", "load_shards", shards, micro)
        adv = placed.actor.call("advantages", rewards, ref_out, value_out, algo, num_returns=2)
        stats = ray.get([s for s, _ in adv])
    valid = int(sum(s["valid"] for s in stats))

    def train(group: RayGroup, method: str, *args: Any) -> Callable[[], list[Any]]:
        """The training call, or none when no sample is valid (the phase is still timed, empty)."""
        return partial(group.call, method, *args) if valid else list

    trainings = [
        PhaseWork("actor_train", placed.actor, train(placed.actor, "train_actor", {**algo, "step": step}))
    ]
    if placed.critic is not None:  # at once with the actor's where another group hosts the critic
        critic_args = ([r for _, r in adv], algo)
        trainings.append(
            PhaseWork("critic_train", placed.critic, train(placed.critic, "train_critic", *critic_args))
        )
    trained = run_phases(timer, trainings)
    actor_stats: list[dict[str, float]] = ray.get(trained["actor_train"])
    critic_stats: list[dict[str, float]] = ray.get(trained.get("critic_train", []))
    trained_tokens = int(sum(s["trained_tokens"] for s in actor_stats))
    if valid:
        ctx.actor_version += 1
    kl_tokens = sum(s["kl_tokens"] for s in stats)
    kl = sum(s["kl_sum"] for s in stats) / max(kl_tokens, 1.0)
    if algo["skip_old_logprobs"] and actor_stats:  # no old log-probs: the training pass measured it
        kl = actor_stats[0]["kl"]
    kl_coef = objective.kl_coef
    advance(objective, spec, stats, kl)
    ctx.checkpointer.algorithm_state = asdict(objective)  # what the next step starts from
    if not asynchronous:  # async: the next step syncs, once the batch generating now is done
        with timer.phase("weight_sync"):
            ctx.sync.engines_sleep(False)
            sync_bytes += ctx.sync.sync() if valid else 0
        ctx.engine_version = ctx.actor_version
    checkpoint = None
    ctx.checkpointer.trained_position = gen.position  # a checkpoint of this step: not the batch drawn ahead
    if ctx.checkpointer.due(step):
        with timer.phase("checkpoint"):
            checkpoint = ctx.checkpointer.save(
                step, [asdict(r) for r in ctx.history], rollout_digest(rollout)
            )

    gen_tokens = (
        gen.generated_tokens
        if gen.generated_tokens is not None
        else sum(m.generated_tokens for m in rollout.metas)
    )
    training = training_stats(stats, actor_stats, critic_stats)
    training["kl_coef"] = kl_coef
    ended = time.monotonic()
    step_seconds = ended - started
    waited = timer.seconds.get("generation", 0.0) + timer.seconds.get("reward", 0.0)
    busy = ctx.generating + ([pending_interval(ctx.ahead, ended)] if ctx.ahead is not None else [])
    ctx.generating = [iv for iv in ctx.generating if iv[1] >= started]  # older ones end before this step
    return StepReport(
        step=step,
        phase_seconds=dict(timer.seconds),
        reward_mean=sum(s["score_sum"] for s in stats) / max(valid, 1),
        kl=kl,
        generated_tokens=gen_tokens,
        trained_tokens=trained_tokens,
        reward_errors=errors,
        valid_samples=valid,
        tokens_per_second=gen_tokens / max(gen.generating_seconds, 1e-9),
        weight_sync_bytes=sync_bytes,
        engines=gen.engines if gen.engines is not None else sorted({m.engine for m in rollout.metas}),
        checkpoint=checkpoint,
        training=training,
        rollout_digest=rollout_digest(rollout),
        step_seconds=step_seconds,
        trainer_idle_ratio=idle_ratio(step_seconds - waited, step_seconds),
        rollout_idle_ratio=idle_ratio(busy_seconds(busy, started, ended), step_seconds),
        generating_seconds=gen.generating_seconds,
        dynamic_sampling=gen.dynamic_sampling,
        weight_sync=ctx.sync.take_stats(),
        agent=gen.agent,
    )


def advance(objective: ObjectiveState, spec: RLHFJobSpec, stats: list[dict[str, float]], kl: float) -> None:
    """The objective's state after a step: the adaptive KL coefficient moved by the step's KL (klTarget),
    and the running score moments the ranks merged (rewardShaping.normalize)."""
    a = spec.algorithm
    if a.kl_target is not None and a.uses_reference:
        controller = AdaptiveKL(objective.kl_coef, a.kl_target, a.kl_horizon)
        objective.kl_coef = controller.update(kl, a.samples_per_step)
    first = next((s for s in stats if "score_count" in s), None)
    if first is not None:
        objective.score_moments = {
            "count": first["score_count"],
            "mean": first["score_mean"],
            "m2": first["score_m2"],
        }


def pending_interval(pending: Pending, now: float) -> tuple[float, float]:
    """When a batch generated ahead kept the engines busy, up to `now`."""
    return pending.interval[0], pending.interval[1] if len(pending.interval) > 1 else now


def generate(
    ctx: StepContext, step: int, chunks: list[Chunk], batch: PromptBatch, timer: PhaseTimer
) -> ChunkDispatcher:
    """The generation phase's work: stream the chunks out of the ready engines (or, with rollout.agent,
    the agent runner's episodes over them), scoring each at once. The dispatcher it returns gathers the
    scores (`scored`), regenerating what a lost engine held."""
    pool, metrics = ctx.placed.pool, ctx.metrics

    def engine_lost(slot: EngineSlot, err: BaseException) -> None:
        pool.mark_lost(slot, err)
        metrics.set_engines(pool.counts())

    dispatcher = new_dispatcher(ctx, step, pool.ready(), sampling(ctx.spec), engine_lost, timer)
    rollout = dispatcher.run(chunks, batch.prompts, batch.labels, batch.columns)
    metrics.generated_tokens.labels(ctx.job).inc(sum(m.generated_tokens for m in rollout.metas))
    return dispatcher


def new_dispatcher(
    ctx: StepContext,
    step: int,
    engines: list[EngineSlot],
    sampling: dict[str, Any],
    engine_lost: Callable[[EngineSlot, BaseException], None],
    timer: PhaseTimer,
) -> ChunkDispatcher:
    """The chunk dispatcher of a generation (training or evaluation): the engines' own chunks, or with
    rollout.agent the agent runner's episodes, its tool calls timed as the `tool` phase."""
    reward = ctx.placed.reward
    if ctx.placed.agent is None:
        return ChunkDispatcher(step, engines, reward, sampling, engine_lost)
    return AgentChunkDispatcher(
        step, engines, reward, sampling, engine_lost, on_tool=tool_phase(timer), runner=ctx.placed.agent
    )


def tool_phase(timer: PhaseTimer) -> Callable[[bool], None]:
    """The `tool` phase, in progress while the agent runner reports tool calls running (within generation:
    the stall alerts name `tool` when a tool hangs)."""
    started: list[float] = []

    def on_tool(busy: bool) -> None:
        if busy and not started:
            started.append(timer.start("tool"))
        elif not busy and started:
            timer.stop("tool", started.pop())

    return on_tool


def training_stats(
    advantage_stats: list[dict[str, float]],
    actor: list[dict[str, float]],
    critic: list[dict[str, float]],
) -> dict[str, float]:
    """The step's training figures: every rank reports the global losses, so the first is taken; the
    first-micro-batch deviations are the largest over ranks."""
    out: dict[str, float] = {}
    if actor:
        keys = ("policy_loss", "clip_frac", "dual_clip_frac", "kl_loss", "entropy", "optimizer_steps",
                "rollout_logprob_gap")  # fmt: skip
        out.update({k: actor[0][k] for k in keys})
        out["first_ratio_deviation"] = max(s["first_ratio_deviation"] for s in actor)
        # each rank's own gap distribution: the largest over ranks (the mean: the first's, one shard's)
        out["logprob_gap_mean"] = actor[0]["logprob_gap_mean"]
        for k in ("logprob_gap_p99", "logprob_gap_max"):
            out[k] = max(s[k] for s in actor)
        for k in ("behaviour_weight_mean", "behaviour_dropped_frac"):  # with algorithm.rolloutCorrection
            if k in actor[0]:
                out[k] = actor[0][k]
    if critic:
        out["value_loss"] = critic[0]["value_loss"]
        out["first_value_deviation"] = max(s["first_value_deviation"] for s in critic)
    if any("zero_advantage_groups" in s for s in advantage_stats):  # grpo, rloo: counted by the ranks
        out["zero_advantage_groups"] = sum(s.get("zero_advantage_groups", 0.0) for s in advantage_stats)
    masked = sum(s.get("truncated_masked", 0.0) for s in advantage_stats)
    if masked:
        out["truncated_masked"] = masked
    ev = [s["explained_variance"] for s in advantage_stats if "explained_variance" in s]
    if ev:
        out["explained_variance"] = ev[0]
    return out


def rollout_digest(rollout: Rollout) -> str:
    """The step's rollout tokens as one short hash, from the engines' per-chunk digests (no tokens here)."""
    import hashlib

    joined = ",".join(m.digest for m in rollout.metas).encode()
    return hashlib.blake2b(joined, digest_size=8).hexdigest()


def balanced(chunks: list[Chunk], metas: list[ChunkMeta]) -> list[Chunk]:
    """The generated chunks given to the trainer ranks by their tokens (`transfer.balance_shards`)."""
    owners = balance_shards(
        [shard for shard, _, _ in chunks],
        [len(idx) for _, _, idx in chunks],
        [m.prompt_tokens + m.response_tokens for m in metas],
    )
    return [(owner, engine, idx) for owner, (_, engine, idx) in zip(owners, chunks, strict=True)]


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
    t = report.training
    if "kl_coef" in t:
        m.kl_coef.labels(ctx.job).set(t["kl_coef"])
    if "entropy" in t:
        m.entropy.labels(ctx.job).set(t["entropy"])
    for stat in ("mean", "p99", "max"):
        if f"logprob_gap_{stat}" in t:
            m.logprob_gap.labels(ctx.job, stat).set(t[f"logprob_gap_{stat}"])
    m.trainer_idle_ratio.labels(ctx.job).set(report.trainer_idle_ratio)
    m.rollout_idle_ratio.labels(ctx.job).set(report.rollout_idle_ratio)
    if report.agent:
        m.agent_step(report.agent)
    m.step_done(report.phase_seconds, report.step_seconds)
