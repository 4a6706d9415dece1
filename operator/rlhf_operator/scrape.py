"""Reads the trainer's Prometheus `/metrics` into a typed snapshot, by the contract table
(`rlhf_api.trainer_metrics`): a row that names a `ScrapedMetrics` field is read into it.

`parse_metrics` is pure and tolerant: malformed text raises `MalformedMetrics` (the caller logs and
ignores it), series the table lacks are only named in `unknown_series` (a newer trainer), and series of
other jobs (another `rlhfjob` label) are skipped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, get_type_hints

import httpx
from prometheus_client.parser import text_string_to_metric_families
from rlhf_api.trainer_metrics import JOB_LABEL, SERIES, series_of

from rlhf_operator.rayjobs import kept_connection, tls_context


class MalformedMetrics(ValueError):
    """The /metrics body is not Prometheus text exposition."""


class MetricsUnavailable(RuntimeError):
    """The endpoint could not be reached (trainer not started yet, or down)."""


@dataclass
class ScrapedMetrics:
    steps_completed: int = 0
    total_steps: int | None = None
    last_step_completed_ts: float | None = None
    driver_started_ts: float | None = None
    stall_timeout_seconds: float | None = None
    step_phase_seconds: dict[str, float] = field(default_factory=dict)
    last_step_seconds: float | None = None  # rlhf_step_seconds
    in_progress_step_phase: str | None = None
    in_progress_since: float | None = None
    generated_tokens_total: float = 0.0
    trained_tokens_total: float = 0.0
    reward_mean: float | None = None
    # The evaluation split (spec.evaluation): None / empty before the first evaluation
    eval_reward_mean: float | None = None
    eval_reward_mean_by_data_source: dict[str, float] = field(default_factory=dict)
    eval_step: int | None = None
    kl: float | None = None
    reward_errors_total: float = 0.0
    weight_sync_bytes_total: float = 0.0
    engines: dict[str, int] = field(default_factory=dict)
    # rlhf_last_checkpoint_step: None when the series is absent (a trainer that predates it, or one
    # that has neither written nor resumed from a checkpoint yet).
    last_checkpoint_step: int | None = None
    # Asynchronous RL and idle time (None: a trainer that predates them)
    trainer_idle_ratio: float | None = None
    rollout_idle_ratio: float | None = None
    staleness_sum: float = 0.0
    staleness_count: float = 0.0
    stale_samples_total: float | None = None
    nccl_networks: dict[str, str] = field(default_factory=dict)  # NCCL process -> network (GPU path)
    # checkpoint.exportTo's upload (None: none started); done and failed read 1 or 0
    export_bytes_done: int | None = None
    export_bytes_total: int | None = None
    export_done: float | None = None
    export_failed: float | None = None
    unknown_series: set[str] = field(default_factory=set)  # samples the contract table has no row for
    # spec.tracking, per sink: its run (URL or directory), failed calls, dropped events, whether its last
    # call worked (1/0) and its last error
    tracking_runs: dict[str, str] = field(default_factory=dict)
    tracking_errors: dict[str, float] = field(default_factory=dict)
    tracking_dropped: dict[str, float] = field(default_factory=dict)
    tracking_up: dict[str, float] = field(default_factory=dict)
    tracking_last_error: dict[str, str] = field(default_factory=dict)
    # rollout.agent's last step (None: a job without agents, or a trainer that predates them)
    agent_turns_per_episode: float | None = None
    agent_tool_calls: float | None = None
    agent_tool_errors: float | None = None
    agent_tool_seconds: float | None = None

    @property
    def sample_staleness(self) -> float | None:
        """Mean staleness of the batches trained so far (rlhf_sample_staleness), None before any."""
        return self.staleness_sum / self.staleness_count if self.staleness_count > 0 else None

    @property
    def step_seconds(self) -> float:
        """The last step's wall time (rlhf_step_seconds); from a trainer image without it, the phases'
        sum, which overstates a step whose phases overlapped."""
        if self.last_step_seconds is not None and self.last_step_seconds > 0:
            return self.last_step_seconds
        return sum(self.step_phase_seconds.values())

    @property
    def generation_share(self) -> float | None:
        total = self.step_seconds
        if total <= 0 or "generation" not in self.step_phase_seconds:
            return None
        return self.step_phase_seconds["generation"] / total


def _converter(name: str) -> Callable[[float], Any]:
    """How a sample's value converts into the field `name`: by the field's type; a timestamp's 0 is
    "not set"."""
    if name in ("last_step_completed_ts", "driver_started_ts"):
        return lambda v: v or None
    return int if "int" in str(get_type_hints(ScrapedMetrics)[name]) else float


# Series whose value is one field of ScrapedMetrics (from the table's `field` column), and how it converts.
_FIELDS: dict[str, tuple[str, Callable[[float], Any]]] = {
    s.name: (s.field, _converter(s.field)) for s in SERIES if s.field is not None
} | {
    "rlhf_sample_staleness_sum": ("staleness_sum", float),
    "rlhf_sample_staleness_count": ("staleness_count", float),
}


def parse_metrics(text: str, rlhfjob: str | None = None) -> ScrapedMetrics:
    out = ScrapedMetrics()
    started: dict[str, float] = {}
    in_progress: list[str] = []
    try:
        families = list(text_string_to_metric_families(text))
    except (ValueError, TypeError, IndexError) as e:
        raise MalformedMetrics(str(e)) from e
    for fam in families:
        for s in fam.samples:
            if rlhfjob is not None and s.labels.get(JOB_LABEL, rlhfjob) != rlhfjob:
                continue
            if series_of(s.name) is None:
                out.unknown_series.add(s.name)
                continue
            _take(out, s.name, float(s.value), s.labels, started, in_progress)
    if in_progress:
        # The most recently started phase is the one the step is waiting on.
        out.in_progress_step_phase = max(in_progress, key=lambda p: started.get(p, 0.0))
        out.in_progress_since = started.get(out.in_progress_step_phase)
    return out


def _take(
    out: ScrapedMetrics,
    name: str,
    value: float,
    labels: dict[str, str],
    started: dict[str, float],
    in_progress: list[str],
) -> None:
    """One sample into `out` (the phases in progress and their start times into the two collections)."""
    target = _FIELDS.get(name)
    if target is not None:
        setattr(out, target[0], target[1](value))
        return
    step_phase = labels.get("phase", "")  # the label keeps its contract name
    if name == "rlhf_step_phase_seconds" and step_phase:
        out.step_phase_seconds[step_phase] = value
    elif name == "rlhf_phase_in_progress" and step_phase and value >= 1:
        in_progress.append(step_phase)
    elif name == "rlhf_phase_started_timestamp_seconds" and step_phase:
        started[step_phase] = value
    elif name == "rlhf_stale_samples_total":
        out.stale_samples_total = (out.stale_samples_total or 0.0) + value
    elif name == "rlhf_eval_source_reward_mean" and "data_source" in labels:
        out.eval_reward_mean_by_data_source[labels["data_source"]] = value
    elif name == "rlhf_nccl_transport" and value >= 1 and "process" in labels:
        out.nccl_networks[labels["process"]] = labels.get("network", "unknown")
    elif name == "rlhf_export_upload_bytes" and labels.get("state") in ("done", "total"):
        setattr(out, f"export_bytes_{labels['state']}", int(value))
    elif name == "rlhf_rollout_engines" and "state" in labels:
        out.engines[labels["state"]] = int(value)
    elif name in _TRACKING_SERIES and "sink" in labels:
        _take_tracking(out, name, value, labels)


# spec.tracking's series, per sink (docs/tracking.md)
_TRACKING_SERIES = frozenset(
    {
        "rlhf_tracking_run_info",
        "rlhf_tracking_errors_total",
        "rlhf_tracking_dropped_total",
        "rlhf_tracking_up",
        "rlhf_tracking_last_error_info",
    }
)


def _take_tracking(out: ScrapedMetrics, name: str, value: float, labels: dict[str, str]) -> None:
    sink = labels["sink"]
    if name == "rlhf_tracking_run_info" and "url" in labels:
        out.tracking_runs[sink] = labels["url"]
    elif name == "rlhf_tracking_errors_total":
        out.tracking_errors[sink] = value
    elif name == "rlhf_tracking_dropped_total":
        out.tracking_dropped[sink] = value
    elif name == "rlhf_tracking_up":
        out.tracking_up[sink] = value
    elif name == "rlhf_tracking_last_error_info" and "error" in labels:
        out.tracking_last_error[sink] = labels["error"]


def client(keepalive: float, timeout: float = 5.0) -> httpx.Client:
    """A job's scrape client, kept between its rounds so its connection to the trainer stays open."""
    return httpx.Client(timeout=timeout, verify=tls_context(), limits=kept_connection(keepalive))


def fetch_metrics(url: str, rlhfjob: str | None = None, http: httpx.Client | None = None) -> ScrapedMetrics:
    """The trainer's metrics at `url`, through `http` (a kept client) or a client of this call's own."""
    try:
        resp = httpx.get(url, timeout=5.0, verify=tls_context()) if http is None else http.get(url)
    except httpx.HTTPError as e:
        raise MetricsUnavailable(f"{url}: {e.__class__.__name__}: {e}") from e
    if resp.status_code != 200:
        raise MetricsUnavailable(f"{url}: HTTP {resp.status_code}")
    return parse_metrics(resp.text, rlhfjob)
