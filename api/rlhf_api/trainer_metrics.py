"""The trainer's metric series: one row per series (name, type, labels, meaning), the table that the
trainer's exporter (`rlhf_trainer.metrics.TrainerExporter`) and the operator's scrape parser
(`rlhf_operator.scrape`) are both built from, and that docs/monitoring.md's list is checked against.

Data only: no Prometheus client here (rlhf_api stays light). Names, labels and types are a contract
with the chart's alert rules and dashboards and with users' queries: change one only with all of them.
Adding a reported series is one row; the operator reads it when the row names a `ScrapedMetrics` field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

# The label every series carries: the RLHFJob's name (never `job`: Prometheus owns it).
JOB_LABEL: Final = "rlhfjob"

# The named phases of one step, in the order a step runs them (rlhf_trainer.loop; docs/monitoring.md).
PHASES: Final[tuple[str, ...]] = (
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
ENGINE_STATES: Final[tuple[str, ...]] = ("starting", "ready", "failed", "stopping")
STALE_ACTIONS: Final[tuple[str, ...]] = ("regenerated", "dropped")
# Why an agent episode ended (agents.contract.END_REASONS): rlhf_agent_episodes_total's end_reason values
AGENT_END_REASONS: Final[tuple[str, ...]] = (
    "done", "max_turns", "token_budget", "tool_timeout", "tool_error", "agent_error"
)  # fmt: skip

Kind = Literal["gauge", "counter", "histogram"]


@dataclass(frozen=True)
class Series:
    """One exported series. `name` is the name on /metrics (a counter's ends in `_total`); `labels` are
    the labels beside `rlhfjob`; `values` gives each label's closed set of values when the series exists
    from the driver's start (`eager`), one child per combination; `field` is the `ScrapedMetrics` field
    the operator reads a label-free series into (None: the operator does not read it, or reads it by its
    labels in `rlhf_operator.scrape`); `buckets` are a histogram's."""

    name: str
    kind: Kind
    labels: tuple[str, ...]
    help: str
    eager: bool = True
    values: tuple[tuple[str, ...], ...] = ()
    field: str | None = None
    buckets: tuple[float, ...] = ()


_P = ("phase",)
_PHASE_VALUES = (PHASES,)

# fmt: off
SERIES: Final[tuple[Series, ...]] = (
    Series("rlhf_step_seconds", "gauge", (), "Wall time of the last completed step (phases that ran at the same time count once)", field="last_step_seconds"),
    Series("rlhf_step_phase_seconds", "gauge", _P, "Duration of each phase in the last completed step", values=_PHASE_VALUES),
    Series("rlhf_phase_duration_seconds", "histogram", _P, "Duration of phases", values=_PHASE_VALUES, buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)),
    Series("rlhf_phase_in_progress", "gauge", _P, "1 while the phase runs", values=_PHASE_VALUES),
    Series("rlhf_phase_started_timestamp_seconds", "gauge", _P, "When the phase last started", values=_PHASE_VALUES),
    Series("rlhf_steps_completed_total", "counter", (), "Completed training steps", field="steps_completed"),
    Series("rlhf_last_step_completed_timestamp_seconds", "gauge", (), "When the last step completed", field="last_step_completed_ts"),
    Series("rlhf_total_steps", "gauge", (), "Steps this run will train", field="total_steps"),
    Series("rlhf_stall_timeout_seconds", "gauge", (), "The stall timeout in force: monitoring.startupTimeoutSeconds until the driver's first step, stallTimeoutSeconds after", field="stall_timeout_seconds"),
    Series("rlhf_driver_started_timestamp_seconds", "gauge", (), "When the running driver started (its start-up lasts until a step completes after it)", field="driver_started_ts"),
    Series("rlhf_generated_tokens_total", "counter", (), "Generated response tokens", field="generated_tokens_total"),
    Series("rlhf_trained_tokens_total", "counter", (), "Response tokens trained on (x epochs)", field="trained_tokens_total"),
    Series("rlhf_reward_mean", "gauge", (), "Mean reward of the last step's valid samples", field="reward_mean"),
    Series("rlhf_kl", "gauge", (), "Mean per-token KL(actor || reference) of the last step", field="kl"),
    Series("rlhf_critic_explained_variance", "gauge", (), "1 - Var(returns - values) / Var(returns) of the last step's valid tokens (gae's critic)", eager=False),
    Series("rlhf_reward_errors_total", "counter", (), "Samples whose reward failed", field="reward_errors_total"),
    Series("rlhf_weight_sync_bytes_total", "counter", (), "Bytes sent to rollout engines", field="weight_sync_bytes_total"),
    Series("rlhf_weight_sync_buckets_total", "counter", ("encoding",), "Buckets of delta weight syncs, by how they were sent (full, gaps, bitmask)", values=(("full", "gaps", "bitmask"),)),
    Series("rlhf_weight_sync_digest_mismatches_total", "counter", (), "Engine workers whose copy of the weights differed from the trainer's at a digest check (each repaired by a full sync)"),
    Series("rlhf_rollout_engines", "gauge", ("state",), "Rollout engines by state", values=(ENGINE_STATES,)),
    Series("rlhf_last_checkpoint_step", "gauge", (), "Step of the last checkpoint written, or resumed from at start (0: none)", field="last_checkpoint_step"),
    Series("rlhf_trainer_idle_ratio", "gauge", (), "Share of the last step the trainer waited for rollouts (generation and reward phases)", field="trainer_idle_ratio"),
    Series("rlhf_rollout_idle_ratio", "gauge", (), "Share of the last step the rollout engines were not generating", field="rollout_idle_ratio"),
    Series("rlhf_sample_staleness", "histogram", (), "Optimizer steps between the weights that generated a trained sample and the policy trained on it", buckets=(0, 1, 2, 3, 4, 6, 8)),
    Series("rlhf_stale_samples_total", "counter", ("action",), "Samples older than algorithm.async.maxStaleness, by what was done with them", values=(STALE_ACTIONS,)),
    Series("rlhf_dynamic_sampling_groups_total", "counter", ("outcome",), "Groups of algorithm.dynamicSampling: equal-reward groups dropped, and equal-reward groups trained because the extra rounds ran out (short)", values=(("dropped", "short"),)),
    Series("rlhf_dynamic_sampling_rounds_total", "counter", (), "Extra generation rounds taken to fill steps with groups whose rewards differ"),
    Series("rlhf_kl_coef", "gauge", (), "The KL coefficient the last step used"),
    Series("rlhf_entropy", "gauge", (), "Mean token entropy of the policy in the last step"),
    Series("rlhf_logprob_gap", "gauge", ("stat",), "Trainer minus engine log-prob of the sampled tokens in the last step (mean signed; p99 and max of its magnitude)", values=(("mean", "p99", "max"),)),
    Series("rlhf_eval_reward_mean", "gauge", (), "Mean reward of the last evaluation's valid samples", eager=False, field="eval_reward_mean"),
    Series("rlhf_eval_source_reward_mean", "gauge", ("data_source",), "Mean reward of the last evaluation's valid samples of each data_source (the column of data.eval)", eager=False),
    Series("rlhf_eval_step", "gauge", (), "Step after which the last evaluation ran", eager=False, field="eval_step"),
    Series("rlhf_eval_reward_errors_total", "counter", (), "Evaluation samples whose reward failed (not in rlhf_reward_errors_total)"),
    Series("rlhf_tracking_errors_total", "counter", ("sink",), "Failed calls to a tracking sink (each retry counts)", eager=False),
    Series("rlhf_tracking_dropped_total", "counter", ("sink",), "Tracking events given up on (retries exhausted, queue full, or left at exit)", eager=False),
    Series("rlhf_tracking_up", "gauge", ("sink",), "1 when the sink's last call succeeded, 0 after a failure", eager=False),
    Series("rlhf_tracking_run_info", "gauge", ("sink", "url"), "The sink's run: its URL or directory (value 1)", eager=False),
    Series("rlhf_tracking_last_error_info", "gauge", ("sink", "error"), "The sink's last error (value: its time); one series per sink", eager=False),
    Series("rlhf_agent_turns_per_episode", "gauge", (), "Mean model turns per episode in the last step", eager=False, field="agent_turns_per_episode"),
    Series("rlhf_agent_tool_calls", "gauge", (), "Tool calls of the last step's episodes", eager=False, field="agent_tool_calls"),
    Series("rlhf_agent_tool_errors", "gauge", (), "Tool calls of the last step's episodes that raised or ran past tool.timeoutSeconds", eager=False, field="agent_tool_errors"),
    Series("rlhf_agent_tool_seconds", "gauge", (), "Seconds the last step's tool calls ran, summed over the calls", eager=False, field="agent_tool_seconds"),
    Series("rlhf_agent_episodes_total", "counter", ("end_reason",), "Agent episodes by why they ended (done, max_turns, token_budget, tool_timeout, tool_error, agent_error)", eager=False, values=(AGENT_END_REASONS,)),
    Series("rlhf_nccl_transport", "gauge", ("process", "network"), "1 per NCCL process and the network NCCL chose for it (IB, Socket, ...; GPU path only)", eager=False),
    Series("rlhf_export_upload_bytes", "gauge", ("state",), "Bytes of the export's upload to checkpoint.exportTo: state done (uploaded or already there) or total", eager=False),
    Series("rlhf_export_upload_done", "gauge", (), "1 once the export's upload wrote its marker (the prefix is a complete model), else 0", eager=False, field="export_done"),
    Series("rlhf_export_upload_failed", "gauge", (), "1 when the export's upload failed for good (after its retries); the local export is kept", eager=False, field="export_failed"),
)
# fmt: on

BY_NAME: Final[dict[str, Series]] = {s.name: s for s in SERIES}

# The sample names a series of each kind puts on /metrics beside its own name (a histogram's parts).
HISTOGRAM_SUFFIXES: Final = ("_bucket", "_sum", "_count")


def sample_names(series: Series) -> tuple[str, ...]:
    """The sample names `series` appears under on /metrics (and in PromQL)."""
    if series.kind == "histogram":
        return tuple(series.name + suffix for suffix in HISTOGRAM_SUFFIXES)
    return (series.name,)


def series_of(sample: str) -> Series | None:
    """The table's series a sample name on /metrics (or in PromQL) belongs to: its own name, a
    histogram's part, or the `_created` sample the client adds to counters and histograms; None when
    the table has no such series."""
    if sample in BY_NAME:
        return BY_NAME[sample]
    stem, _, suffix = sample.rpartition("_")
    if f"_{suffix}" in HISTOGRAM_SUFFIXES:
        found = BY_NAME.get(stem)
        return found if found is not None and found.kind == "histogram" else None
    if suffix == "created":
        return BY_NAME.get(stem) or BY_NAME.get(stem + "_total")
    return None
