"""The trainer's Prometheus exporter and the training-phase timer.

`TrainerExporter` builds every series from the contract table (`rlhf_api.trainer_metrics`, label
`rlhfjob`) and serves them on /metrics; `PhaseTimer` marks a phase of a step in progress, times it and
exports it. Names no series of its own: a new series is a row of the table.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.metrics import MetricWrapperBase
from rlhf_api import read_only_http
from rlhf_api.trainer_metrics import (
    AGENT_END_REASONS,
    ENGINE_STATES,
    JOB_LABEL,
    PHASES,
    SERIES,
    STALE_ACTIONS,
    Series,
)

if TYPE_CHECKING:
    from rlhf_api.spec import MonitoringSpec

__all__ = ["AGENT_END_REASONS", "ENGINE_STATES", "PHASES", "STALE_ACTIONS", "PhaseTimer", "TrainerExporter"]
_M = TypeVar("_M", bound=MetricWrapperBase)


def _make(series: Series, registry: CollectorRegistry) -> MetricWrapperBase:
    """One Prometheus metric from its row of the contract table (a counter's `_total` is added back by
    the client)."""
    labels = [JOB_LABEL, *series.labels]
    if series.kind == "histogram":
        return Histogram(series.name, series.help, labels, buckets=series.buckets, registry=registry)
    kind = Counter if series.kind == "counter" else Gauge
    return kind(series.name, series.help, labels, registry=registry)


class TrackingSeries:
    """The tracking sinks' series (spec.tracking; docs/tracking.md; rows of the contract table) and the
    dispatcher's `Observer` (rlhf_trainer.tracking.dispatch): a failed call counts in
    rlhf_tracking_errors_total and replaces the sink's rlhf_tracking_last_error_info; rlhf_tracking_up
    says whether its last call worked."""

    def __init__(self, exporter: TrainerExporter) -> None:
        self.job = exporter.job
        self.errors = exporter.counter("rlhf_tracking_errors_total")
        self.dropped = exporter.counter("rlhf_tracking_dropped_total")
        self.up = exporter.gauge("rlhf_tracking_up")
        self.run_info = exporter.gauge("rlhf_tracking_run_info")
        self.last_error = exporter.gauge("rlhf_tracking_last_error_info")
        self._errors: dict[str, str] = {}

    def tracking_started(self, sink: str, url: str) -> None:
        self.run_info.labels(self.job, sink, url).set(1)
        self.errors.labels(self.job, sink)
        self.dropped.labels(self.job, sink)

    def tracking_failed(self, sink: str, error: str) -> None:
        self.errors.labels(self.job, sink).inc()
        self.up.labels(self.job, sink).set(0)
        old = self._errors.get(sink)
        if old is not None and old != error:
            self.last_error.remove(self.job, sink, old)
        self._errors[sink] = error
        self.last_error.labels(self.job, sink, error).set(time.time())

    def tracking_succeeded(self, sink: str) -> None:
        self.up.labels(self.job, sink).set(1)

    def tracking_dropped(self, sink: str, events: int) -> None:
        self.dropped.labels(self.job, sink).inc(events)


class TrainerExporter:
    """Every series of the contract table (rlhf_api.trainer_metrics), in its own registry (so tests can
    build several), served on /metrics. `series` holds them by name; the attributes name the ones the
    trainer sets.

    (The operator's `rlhf_operator.scrape.ScrapedMetrics` is the other side: values parsed from a scrape.)
    """

    def __init__(self, job: str, registry: CollectorRegistry | None = None) -> None:
        self.job = job
        self.registry = registry or CollectorRegistry()
        self.series = {s.name: _make(s, self.registry) for s in SERIES}
        # Create every child of an eager series now so /metrics shows the full contract from the first
        # scrape (a lazy one, such as the critic's or the evaluation's, appears when first set).
        for s in SERIES:
            if s.eager:
                for values in itertools.product(*s.values):
                    self.series[s.name].labels(job, *values)
        self.step_phase_seconds = self.gauge("rlhf_step_phase_seconds")
        self.phase_duration = self.histogram("rlhf_phase_duration_seconds")
        self.phase_in_progress = self.gauge("rlhf_phase_in_progress")
        self.phase_started = self.gauge("rlhf_phase_started_timestamp_seconds")
        self.step_seconds = self.gauge("rlhf_step_seconds")
        self.steps_completed = self.counter("rlhf_steps_completed_total")
        self.last_step_ts = self.gauge("rlhf_last_step_completed_timestamp_seconds")
        self.driver_started_ts = self.gauge("rlhf_driver_started_timestamp_seconds")
        self._step_timeout: int | None = None
        self.total_steps = self.gauge("rlhf_total_steps")
        self.stall_timeout = self.gauge("rlhf_stall_timeout_seconds")
        self.nccl_transport = self.gauge("rlhf_nccl_transport")
        self.generated_tokens = self.counter("rlhf_generated_tokens_total")
        self.trained_tokens = self.counter("rlhf_trained_tokens_total")
        self.reward_mean = self.gauge("rlhf_reward_mean")
        self.kl = self.gauge("rlhf_kl")
        self.explained_variance = self.gauge("rlhf_critic_explained_variance")
        self.reward_errors = self.counter("rlhf_reward_errors_total")
        self.weight_sync_bytes = self.counter("rlhf_weight_sync_bytes_total")
        self.weight_sync_buckets = self.counter("rlhf_weight_sync_buckets_total")
        self.weight_sync_digest_mismatches = self.counter("rlhf_weight_sync_digest_mismatches_total")
        self.rollout_engines = self.gauge("rlhf_rollout_engines")
        self.last_checkpoint_step = self.gauge("rlhf_last_checkpoint_step")
        self.sample_staleness = self.histogram("rlhf_sample_staleness")
        self.trainer_idle_ratio = self.gauge("rlhf_trainer_idle_ratio")
        self.rollout_idle_ratio = self.gauge("rlhf_rollout_idle_ratio")
        self.stale_samples = self.counter("rlhf_stale_samples_total")
        self.dynamic_sampling_groups = self.counter("rlhf_dynamic_sampling_groups_total")
        self.dynamic_sampling_rounds = self.counter("rlhf_dynamic_sampling_rounds_total")
        self.kl_coef = self.gauge("rlhf_kl_coef")
        self.logprob_gap = self.gauge("rlhf_logprob_gap")
        self.entropy = self.gauge("rlhf_entropy")
        self.eval_reward_mean = self.gauge("rlhf_eval_reward_mean")
        self.eval_source_reward_mean = self.gauge("rlhf_eval_source_reward_mean")
        self.eval_step = self.gauge("rlhf_eval_step")
        self.eval_reward_errors = self.counter("rlhf_eval_reward_errors_total")
        # rollout.agent's episodes in the last step (created by `agentic`, so a job without agents shows none)
        self.agent_turns = self.gauge("rlhf_agent_turns_per_episode")
        self.agent_tool_calls = self.gauge("rlhf_agent_tool_calls")
        self.agent_tool_errors = self.gauge("rlhf_agent_tool_errors")
        self.agent_tool_seconds = self.gauge("rlhf_agent_tool_seconds")
        self.agent_episodes = self.counter("rlhf_agent_episodes_total")
        self.tracking = TrackingSeries(self)

    def gauge(self, name: str) -> Gauge:
        """The gauge of the table's row `name` (a new row needs no attribute: `exporter.gauge(name)`)."""
        return self._typed(name, Gauge)

    def counter(self, name: str) -> Counter:
        return self._typed(name, Counter)

    def histogram(self, name: str) -> Histogram:
        return self._typed(name, Histogram)

    def _typed(self, name: str, kind: type[_M]) -> _M:
        metric = self.series[name]
        if not isinstance(metric, kind):
            raise TypeError(f"{name} is a {type(metric).__name__}, not a {kind.__name__}")
        return metric

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        """/metrics only, read-only (docs/security.md). Every address of the pod by default: Prometheus
        and the operator scrape it from outside; RLHF_METRICS_ADDR narrows it (the tests' local head)."""
        app = read_only_http.guard(make_wsgi_app(self.registry), ["/metrics"])
        read_only_http.serve(app, os.environ.get("RLHF_METRICS_ADDR") or addr, port)

    def set_engines(self, counts: dict[str, int]) -> None:
        for state in ENGINE_STATES:
            self.rollout_engines.labels(self.job, state).set(counts.get(state, 0))

    def driver_started(self, monitoring: MonitoringSpec, at: float | None = None) -> None:
        """The driver's start: `rlhf_last_step_completed_timestamp_seconds` holds it until the first step
        completes, so the step-stall alert also catches a run stuck in (or before) its first step, held
        to the start-up timeout (`rlhf_stall_timeout_seconds`) until then; the operator reads the start
        from `rlhf_driver_started_timestamp_seconds`."""
        started = time.time() if at is None else at
        self.last_step_ts.labels(self.job).set(started)
        self.driver_started_ts.labels(self.job).set(started)
        self._step_timeout = monitoring.timeout_in_force(first_step_done=True)
        self.stall_timeout.labels(self.job).set(monitoring.timeout_in_force(first_step_done=False))

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

    def export_uploading(self, bytes_done: int, bytes_total: int, done: bool, failed: bool) -> None:
        """The export upload's progress (export_upload.Progress)."""
        self.gauge("rlhf_export_upload_bytes").labels(self.job, "done").set(bytes_done)
        self.gauge("rlhf_export_upload_bytes").labels(self.job, "total").set(bytes_total)
        self.gauge("rlhf_export_upload_done").labels(self.job).set(1 if done else 0)
        self.gauge("rlhf_export_upload_failed").labels(self.job).set(1 if failed else 0)

    def step_done(self, phase_seconds: dict[str, float], seconds: float) -> None:
        """A step ended: its phases' own wall times (which may overlap) and the step's."""
        self.step_seconds.labels(self.job).set(seconds)
        for phase in PHASES:  # a phase that did not run in this step reports 0, not its last duration
            self.step_phase_seconds.labels(self.job, phase).set(phase_seconds.get(phase, 0.0))
        self.steps_completed.labels(self.job).inc()
        self.last_step_ts.labels(self.job).set(time.time())
        if self._step_timeout is not None:  # start-up is over: the step timeout holds from here
            self.stall_timeout.labels(self.job).set(self._step_timeout)


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
