"""The scraped trainer metrics into a running job's typed status: step, progress, throughput, phase timings,
reward, KL, idle ratios, staleness, checkpoint step, ready engines, and the MetricsUnavailable and fabric
conditions; the typed condition upsert. Pure: no I/O; must not import kopf or the Kubernetes client.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime
from typing import Any, Literal

from rlhf_api.spec import AgentStatus, Condition, RLHFJobSpec, RLHFJobStatus, RolloutStatus

from rlhf_operator.fabric import asks_rdma, fabric_condition
from rlhf_operator.scrape import ScrapedMetrics


def conditions_wire(conditions: list[Condition] | None) -> list[dict[str, Any]]:
    """Typed conditions as dicts, for the dict-based condition helpers."""
    return [c.model_dump(by_alias=True, exclude_none=True, mode="json") for c in conditions or []]


def conditions_typed(conditions: list[dict[str, Any]]) -> list[Condition]:
    return [Condition.model_validate(c) for c in conditions]


def upsert_condition(
    conditions: list[Condition], ctype: str, status: bool, reason: str, message: str, now: datetime
) -> list[Condition]:
    """The typed twin of conditions.set_condition: a new list; lastTransitionTime moves only when the
    status flips."""
    value: Literal["True", "False"] = "True" if status else "False"
    out = list(conditions)
    for i, c in enumerate(out):
        if c.type == ctype:
            moved = {"last_transition_time": second(now)} if c.status != value else {}
            out[i] = c.model_copy(update={"status": value, "reason": reason, "message": message, **moved})
            return out
    out.append(
        Condition(type=ctype, status=value, reason=reason, message=message, last_transition_time=second(now))
    )
    return out


def second(ts: datetime) -> datetime:
    """`ts` to the second, as Kubernetes writes times (conditions.iso)."""
    return ts.replace(microsecond=0)


def apply_metrics(
    st: RLHFJobStatus,
    spec: RLHFJobSpec,
    metrics: ScrapedMetrics | None,
    metrics_error: str | None,
    now: datetime,
) -> tuple[RLHFJobStatus, str | None]:
    """`st` with the scrape copied in (or MetricsUnavailable set), and the fabric's degradation message
    when it is new (for a Warning FabricDegraded)."""
    if metrics is None:
        reason = metrics_error or "no metrics yet"
        conds = upsert_condition(st.conditions or [], "MetricsUnavailable", True, "ScrapeFailed", reason, now)
        return st.model_copy(update={"conditions": conds}), None
    conds = upsert_condition(st.conditions or [], "MetricsUnavailable", False, "Scraped", "", now)
    degraded = None
    if metrics.nccl_networks and asks_rdma(spec):  # else fabric_condition changes nothing
        wire, degraded = fabric_condition(conditions_wire(conds), True, metrics.nccl_networks, now)
        conds = conditions_typed(wire)
    changes = {**_step_fields(st, spec, metrics), **_gauges(metrics), "conditions": conds}
    if metrics.engines:
        rollout = st.rollout or RolloutStatus()
        changes["rollout"] = rollout.model_copy(
            update={"ready_engines": int(metrics.engines.get("ready", 0))}
        )
    return st.model_copy(update=changes), degraded


def _step_fields(st: RLHFJobStatus, spec: RLHFJobSpec, m: ScrapedMetrics) -> dict[str, Any]:
    """Step, progress, generated tokens, throughput and lastStepTime from the step counters."""
    out: dict[str, Any] = {}
    # Throughput between two observed step completions: generated tokens per wall-clock second, from the
    # previous status (so it survives an operator restart). Computed before step/lastStepTime move on.
    prev_step, prev_tokens, prev_time = st.step or 0, st.generated_tokens, st.last_step_time
    completed = (
        datetime.fromtimestamp(m.last_step_completed_ts, UTC).replace(microsecond=0)
        if m.last_step_completed_ts
        else None
    )
    if m.last_step_completed_ts and m.steps_completed > prev_step and prev_tokens is not None and prev_time:
        new_time = datetime.fromtimestamp(m.last_step_completed_ts, UTC)
        delta = m.generated_tokens_total - float(prev_tokens)
        if new_time > prev_time and delta >= 0:
            out["tokens_per_second"] = round(delta / (new_time - prev_time).total_seconds(), 1)
    if m.steps_completed != prev_step or prev_tokens is None:
        out["generated_tokens"] = int(m.generated_tokens_total)
    out["step"] = m.steps_completed
    total = m.total_steps or spec.algorithm.total_steps
    out["total_steps"] = total
    out["progress"] = f"{m.steps_completed}/{total}"
    # Before a run's first step the trainer's timestamp holds the driver's start (so the step-stall alert
    # covers step 1); that is not a step completion, so lastStepTime only moves when the step count does.
    if completed and (m.steps_completed > prev_step or (m.steps_completed and not prev_time)):
        out["last_step_time"] = completed
    return out


def _gauges(m: ScrapedMetrics) -> dict[str, Any]:
    """Phase timings, shares, reward, KL, the evaluation split's reward, idle ratios, staleness and the
    checkpoint step."""
    out: dict[str, Any] = {"current_phase": m.in_progress_step_phase}  # None (removed) between phases
    if m.step_phase_seconds:
        out["phase_seconds"] = {k: round(v, 3) for k, v in sorted(m.step_phase_seconds.items())}
    if m.generation_share is not None:
        out["generation_share"] = round(m.generation_share, 3)
    if m.reward_mean is not None and math.isfinite(m.reward_mean):
        out["reward_mean"] = round(m.reward_mean, 4)
    if m.kl is not None and math.isfinite(m.kl):
        out["kl"] = round(m.kl, 6)
    if m.eval_reward_mean is not None and math.isfinite(m.eval_reward_mean):
        out["eval_reward_mean"] = round(m.eval_reward_mean, 4)
    by_source = {
        k: round(v, 4) for k, v in sorted(m.eval_reward_mean_by_data_source.items()) if math.isfinite(v)
    }
    if by_source:
        out["eval_reward_mean_by_data_source"] = by_source
    if m.eval_step is not None:
        out["eval_step"] = m.eval_step
    if m.steps_completed:  # the idle gauges read 0 until a step of this attempt completes
        for key, ratio in (
            ("trainer_idle_ratio", m.trainer_idle_ratio),
            ("rollout_idle_ratio", m.rollout_idle_ratio),
        ):
            if ratio is not None and math.isfinite(ratio):
                out[key] = round(ratio, 3)
    if m.sample_staleness is not None:
        out["sample_staleness"] = round(m.sample_staleness, 3)
    if m.stale_samples_total is not None:
        out["stale_samples"] = int(m.stale_samples_total)
    if m.last_checkpoint_step is not None:  # absent: keep the last known (checkpoints outlive attempts)
        out["last_checkpoint_step"] = m.last_checkpoint_step
    agent = _agent(m)
    if agent is not None:
        out["agent"] = agent
    return out


def _agent(m: ScrapedMetrics) -> AgentStatus | None:
    """rollout.agent's last step, once a step of this attempt reported it (the gauges read 0 before)."""
    figures = (m.agent_turns_per_episode, m.agent_tool_calls, m.agent_tool_errors, m.agent_tool_seconds)
    if not m.steps_completed or any(v is None or not math.isfinite(v) for v in figures):
        return None
    turns, calls, errors, seconds = (float(v) for v in figures)  # type: ignore[arg-type]
    return AgentStatus(
        turns_per_episode=round(turns, 3),
        tool_calls=int(calls),
        tool_errors=int(errors),
        tool_seconds=round(seconds, 3),
    )
