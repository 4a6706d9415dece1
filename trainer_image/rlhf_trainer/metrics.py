"""The trainer's Prometheus metrics (the docs/monitoring.md contract, label `rlhfjob`) and the training-phase timer.

Owns the metric names (`TrainerExporter`, served on /metrics) and the `PhaseTimer` that marks a phase of
a step in progress, times it and exports it. Never uses a label named `job` (Prometheus would rename it
to exported_job).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app
from rlhf_api import read_only_http

PHASES = (
    "generation",
    "reward",
    "reference",
    "critic_values",
    "old_logprobs",
    "advantages",
    "actor_train",
    "critic_train",
    "weight_sync",
    "checkpoint",
    "eval",  # the evaluation split (spec.evaluation), after the step's training: never a training sample
    "tool",  # rollout.agent: tool calls running, within generation (a hung tool is named by the alerts)
)
ENGINE_STATES = ("starting", "ready", "failed", "stopping")
# Why an agent episode ended (agents.contract.END_REASONS): rlhf_agent_episodes_total's end_reason values
AGENT_END_REASONS = ("done", "max_turns", "token_budget", "tool_timeout", "tool_error", "agent_error")
STALE_ACTIONS = ("regenerated", "dropped")
L = "rlhfjob"


class TrainerExporter:
    """Every series of the docs/monitoring.md contract, in its own registry (so tests can build several), served on /metrics.

    (The operator's `rlhf_operator.scrape.TrainerMetrics` is the other side: values parsed from a scrape.)
    """

    def __init__(self, job: str, registry: CollectorRegistry | None = None) -> None:
        self.job = job
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.step_phase_seconds = Gauge(
            "rlhf_step_phase_seconds",
            "Duration of each phase in the last completed step",
            [L, "phase"],
            registry=r,
        )
        self.phase_duration = Histogram(
            "rlhf_phase_duration_seconds",
            "Duration of phases",
            [L, "phase"],
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800),
            registry=r,
        )
        self.phase_in_progress = Gauge(
            "rlhf_phase_in_progress", "1 while the phase runs", [L, "phase"], registry=r
        )
        self.phase_started = Gauge(
            "rlhf_phase_started_timestamp_seconds", "When the phase last started", [L, "phase"], registry=r
        )
        self.step_seconds = Gauge(
            "rlhf_step_seconds",
            "Wall time of the last completed step (phases that ran at the same time count once)",
            [L],
            registry=r,
        )
        self.steps_completed = Counter("rlhf_steps_completed", "Completed training steps", [L], registry=r)
        self.last_step_ts = Gauge(
            "rlhf_last_step_completed_timestamp_seconds", "When the last step completed", [L], registry=r
        )
        self.total_steps = Gauge("rlhf_total_steps", "Steps this run will train", [L], registry=r)
        self.stall_timeout = Gauge(
            "rlhf_stall_timeout_seconds", "The job's monitoring.stallTimeoutSeconds", [L], registry=r
        )
        self.nccl_transport = Gauge(
            "rlhf_nccl_transport",
            "1 per NCCL process and the network NCCL chose for it (IB, Socket, ...; GPU path only)",
            [L, "process", "network"],
            registry=r,
        )
        self.generated_tokens = Counter("rlhf_generated_tokens", "Generated response tokens", [L], registry=r)
        self.trained_tokens = Counter(
            "rlhf_trained_tokens", "Response tokens trained on (x epochs)", [L], registry=r
        )
        self.reward_mean = Gauge(
            "rlhf_reward_mean", "Mean reward of the last step's valid samples", [L], registry=r
        )
        self.kl = Gauge("rlhf_kl", "Mean per-token KL(actor || reference) of the last step", [L], registry=r)
        # Only with a critic (gae): created at the first step that has one, so a critic-free job shows none.
        self.explained_variance = Gauge(
            "rlhf_critic_explained_variance",
            "1 - Var(returns - values) / Var(returns) of the last step's valid tokens (gae's critic)",
            [L],
            registry=r,
        )
        self.reward_errors = Counter("rlhf_reward_errors", "Samples whose reward failed", [L], registry=r)
        self.weight_sync_bytes = Counter(
            "rlhf_weight_sync_bytes", "Bytes sent to rollout engines", [L], registry=r
        )
        # weightSync.delta: buckets sent by encoding, and engine copies found unlike the trainer's
        self.weight_sync_buckets = Counter(
            "rlhf_weight_sync_buckets",
            "Buckets of delta weight syncs, by how they were sent (full, gaps, bitmask)",
            [L, "encoding"],
            registry=r,
        )
        self.weight_sync_digest_mismatches = Counter(
            "rlhf_weight_sync_digest_mismatches",
            "Engine workers whose copy of the weights differed from the trainer's at a digest check "
            "(each repaired by a full sync)",
            [L],
            registry=r,
        )
        self.rollout_engines = Gauge(
            "rlhf_rollout_engines", "Rollout engines by state", [L, "state"], registry=r
        )
        self.last_checkpoint_step = Gauge(
            "rlhf_last_checkpoint_step",
            "Step of the last checkpoint written, or resumed from at start (0: none)",
            [L],
            registry=r,
        )
        # Asynchronous RL (algorithm.async); the idle ratios are exported in both modes.
        self.sample_staleness = Histogram(
            "rlhf_sample_staleness",
            "Optimizer steps between the weights that generated a trained sample and the policy trained on it",
            [L],
            buckets=(0, 1, 2, 3, 4, 6, 8),
            registry=r,
        )
        self.trainer_idle_ratio = Gauge(
            "rlhf_trainer_idle_ratio",
            "Share of the last step the trainer waited for rollouts (generation and reward phases)",
            [L],
            registry=r,
        )
        self.rollout_idle_ratio = Gauge(
            "rlhf_rollout_idle_ratio",
            "Share of the last step the rollout engines were not generating",
            [L],
            registry=r,
        )
        self.stale_samples = Counter(
            "rlhf_stale_samples",
            "Samples older than algorithm.async.maxStaleness, by what was done with them",
            [L, "action"],
            registry=r,
        )
        # The objective (spec.algorithm): dynamic sampling, the adaptive KL, the train-inference gap.
        self.dynamic_sampling_groups = Counter(
            "rlhf_dynamic_sampling_groups",
            "Groups of algorithm.dynamicSampling: equal-reward groups dropped, and equal-reward groups trained "
            "because the extra rounds ran out (short)",
            [L, "outcome"],
            registry=r,
        )
        self.dynamic_sampling_rounds = Counter(
            "rlhf_dynamic_sampling_rounds",
            "Extra generation rounds taken to fill steps with groups whose rewards differ",
            [L],
            registry=r,
        )
        self.kl_coef = Gauge("rlhf_kl_coef", "The KL coefficient the last step used", [L], registry=r)
        self.logprob_gap = Gauge(
            "rlhf_logprob_gap",
            "Trainer minus engine log-prob of the sampled tokens in the last step (mean signed; p99 and max "
            "of its magnitude)",
            [L, "stat"],
            registry=r,
        )
        self.entropy = Gauge(
            "rlhf_entropy", "Mean token entropy of the policy in the last step", [L], registry=r
        )
        # The evaluation split (spec.evaluation): absent until the first evaluation, then its last values.
        self.eval_reward_mean = Gauge(
            "rlhf_eval_reward_mean", "Mean reward of the last evaluation's valid samples", [L], registry=r
        )
        self.eval_source_reward_mean = Gauge(
            "rlhf_eval_source_reward_mean",
            "Mean reward of the last evaluation's valid samples of each data_source (the column of data.eval)",
            [L, "data_source"],
            registry=r,
        )
        self.eval_step = Gauge("rlhf_eval_step", "Step after which the last evaluation ran", [L], registry=r)
        self.eval_reward_errors = Counter(
            "rlhf_eval_reward_errors",
            "Evaluation samples whose reward failed (not in rlhf_reward_errors_total)",
            [L],
            registry=r,
        )
        # rollout.agent's episodes in the last step (created by `agentic`, so a job without agents shows none)
        self.agent_turns = Gauge(
            "rlhf_agent_turns_per_episode", "Mean model turns per episode in the last step", [L], registry=r
        )
        self.agent_tool_calls = Gauge(
            "rlhf_agent_tool_calls", "Tool calls of the last step's episodes", [L], registry=r
        )
        self.agent_tool_errors = Gauge(
            "rlhf_agent_tool_errors",
            "Tool calls of the last step's episodes that raised or ran past tool.timeoutSeconds",
            [L],
            registry=r,
        )
        self.agent_tool_seconds = Gauge(
            "rlhf_agent_tool_seconds",
            "Seconds the last step's tool calls ran, summed over the calls",
            [L],
            registry=r,
        )
        self.agent_episodes = Counter(
            "rlhf_agent_episodes",
            "Agent episodes by why they ended (done, max_turns, token_budget, tool_timeout, tool_error, "
            "agent_error)",
            [L, "end_reason"],
            registry=r,
        )
        # Create every labelled child now so /metrics shows the full contract from the first scrape.
        for phase in PHASES:
            self.step_phase_seconds.labels(job, phase)
            self.phase_duration.labels(job, phase)
            self.phase_in_progress.labels(job, phase).set(0)
            self.phase_started.labels(job, phase)
        for state in ENGINE_STATES:
            self.rollout_engines.labels(job, state).set(0)
        for action in STALE_ACTIONS:
            self.stale_samples.labels(job, action)
        for outcome in ("dropped", "short"):
            self.dynamic_sampling_groups.labels(job, outcome)
        self.dynamic_sampling_rounds.labels(job)
        self.kl_coef.labels(job)
        self.entropy.labels(job)
        for stat in ("mean", "p99", "max"):
            self.logprob_gap.labels(job, stat)
        self.sample_staleness.labels(job)
        for encoding in ("full", "gaps", "bitmask"):
            self.weight_sync_buckets.labels(job, encoding)
        self.weight_sync_digest_mismatches.labels(job)
        for c in (
            self.eval_reward_errors,
            self.steps_completed,
            self.generated_tokens,
            self.trained_tokens,
            self.reward_errors,
            self.weight_sync_bytes,
        ):
            c.labels(job)
        for g in (
            self.step_seconds,
            self.last_step_ts,
            self.total_steps,
            self.stall_timeout,
            self.reward_mean,
            self.kl,
            self.last_checkpoint_step,
            self.trainer_idle_ratio,
            self.rollout_idle_ratio,
        ):
            g.labels(job)

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        """/metrics only, read-only (docs/security.md). Every address of the pod by default: Prometheus
        and the operator scrape it from outside; RLHF_METRICS_ADDR narrows it (the tests' local head)."""
        app = read_only_http.guard(make_wsgi_app(self.registry), ["/metrics"])
        read_only_http.serve(app, os.environ.get("RLHF_METRICS_ADDR") or addr, port)

    def set_engines(self, counts: dict[str, int]) -> None:
        for state in ENGINE_STATES:
            self.rollout_engines.labels(self.job, state).set(counts.get(state, 0))

    def driver_started(self, at: float | None = None) -> None:
        """The driver's start: `rlhf_last_step_completed_timestamp_seconds` holds it until the first step
        completes, so the step-stall alert also catches a run stuck in (or before) its first step."""
        self.last_step_ts.labels(self.job).set(time.time() if at is None else at)

    def resumed(self, steps_done: int) -> None:
        """After a resume from step N's checkpoint (called once, before any step), `rlhf_steps_completed_total`
        continues from N instead of restarting at 0."""
        if steps_done > 0:
            self.steps_completed.labels(self.job).inc(steps_done)

    def checkpointed(self, step: int) -> None:
        """A checkpoint of `step` was written, or the run resumed from it."""
        self.last_checkpoint_step.labels(self.job).set(step)

    def agentic(self) -> None:
        """The job runs agent episodes (rollout.agent): its series exist from the first scrape."""
        for g in (self.agent_turns, self.agent_tool_calls, self.agent_tool_errors, self.agent_tool_seconds):
            g.labels(self.job)
        for reason in AGENT_END_REASONS:
            self.agent_episodes.labels(self.job, reason)

    def agent_step(self, stats: dict[str, float]) -> None:
        """A step's episode figures (agents.episodes.episode_stats, merged over its chunks)."""
        self.agent_turns.labels(self.job).set(stats.get("turns_mean", 0.0))
        self.agent_tool_calls.labels(self.job).set(stats.get("tool_calls", 0.0))
        self.agent_tool_errors.labels(self.job).set(stats.get("tool_errors", 0.0))
        self.agent_tool_seconds.labels(self.job).set(stats.get("tool_seconds", 0.0))
        for reason in AGENT_END_REASONS:
            self.agent_episodes.labels(self.job, reason).inc(stats.get(f"end_{reason}", 0.0))

    def evaluated(self, step: int, reward_mean: float, by_source: dict[str, float], errors: int) -> None:
        """An evaluation after `step`: its mean reward, per data_source, and its reward errors."""
        self.eval_reward_mean.labels(self.job).set(reward_mean)
        for source, mean in by_source.items():
            self.eval_source_reward_mean.labels(self.job, source).set(mean)
        self.eval_step.labels(self.job).set(step)
        self.eval_reward_errors.labels(self.job).inc(errors)

    def step_done(self, phase_seconds: dict[str, float], seconds: float) -> None:
        """A step ended: its phases' own wall times (which may overlap) and the step's."""
        self.step_seconds.labels(self.job).set(seconds)
        for phase in PHASES:  # a phase that did not run in this step reports 0, not its last duration
            self.step_phase_seconds.labels(self.job, phase).set(phase_seconds.get(phase, 0.0))
        self.steps_completed.labels(self.job).inc()
        self.last_step_ts.labels(self.job).set(time.time())


class PhaseTimer:
    """Times the named phases of one step: `with timer.phase("generation"): ...`, or `start`/`stop` for
    phases that run at once (overlap.run_phases: the experience forwards, the two trainings). Each phase
    is in progress from its own start to its own stop, so the seconds of a step's phases may sum to more
    than the step. A phase never overlaps itself."""

    def __init__(
        self,
        metrics: TrainerExporter | None = None,
        on_start: Callable[[str], None] | None = None,
        on_stop: Callable[[str, float], None] | None = None,
    ) -> None:
        self.metrics = metrics
        self.on_start = on_start  # called once a phase is marked in progress (fault injection hooks here)
        self.on_stop = on_stop  # called with the phase and its seconds once it ends (the hang watch)
        self.seconds: dict[str, float] = {}
        self.running: dict[str, float] = {}  # phase -> when it started (perf_counter), in start order

    def start(self, name: str) -> float:
        if name not in PHASES:
            raise ValueError(f"unknown phase {name!r}")
        if self.metrics is not None:
            job = self.metrics.job
            self.metrics.phase_in_progress.labels(job, name).set(1)
            self.metrics.phase_started.labels(job, name).set(time.time())
        t0 = time.perf_counter()
        self.running[name] = t0
        if self.on_start is not None:
            self.on_start(name)
        return t0

    def stop(self, name: str, started: float) -> float:
        elapsed = time.perf_counter() - started
        self.seconds[name] = self.seconds.get(name, 0.0) + elapsed
        self.running.pop(name, None)
        if self.metrics is not None:
            job = self.metrics.job
            self.metrics.phase_in_progress.labels(job, name).set(0)
            self.metrics.phase_duration.labels(job, name).observe(elapsed)
        if self.on_stop is not None:
            self.on_stop(name, elapsed)
        return elapsed

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = self.start(name)
        try:
            yield
        finally:
            self.stop(name, t0)
