"""Stall detection: whether a running RLHFJob has completed no step for longer than its stall timeout,
and which training phase it is stuck in. Pure: no clock, no I/O, no kopf or Kubernetes client; the
handler passes `now` and the observations, and decides what a stall does (Event, restart).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from rlhf_api.spec import MonitoringSpec

from rlhf_operator.conditions import iso, set_condition
from rlhf_operator.scrape import ScrapedMetrics

CONDITION_TYPE = "Stalled"
# Reason when the phase in progress is unknown: metrics unavailable, or no phase running (between phases).
STEP_STALLED = "StepStalled"
PHASE_STUCK = "PhaseStuck"
NOT_STALLED = "Progressing"


@dataclass(frozen=True)
class Stall:
    """A stall verdict: no step completed for `seconds_since_progress` (more than `timeout_seconds`).

    `step_phase` is the training step's phase in progress (None when unknown) and `step_phase_running_seconds` how long
    it has been running (None when unknown). `scraped` is False when the trainer could not be scraped,
    so the verdict rests on the last progress the operator knew of.
    """

    step_phase: str | None
    seconds_since_progress: float
    step_phase_running_seconds: float | None
    timeout_seconds: int
    last_progress: datetime
    scraped: bool
    startup: bool = False  # the attempt has completed no step: held to startupTimeoutSeconds

    @property
    def reason(self) -> str:
        """`PhaseStuck:<phase>` (e.g. `PhaseStuck:reward`), or `StepStalled` when the phase is unknown.

        Any character of the phase name other than a letter, digit or `_` becomes `_`, so the reason
        stays valid for a metav1.Condition.
        """
        return f"{PHASE_STUCK}:{self.step_phase_label}" if self.step_phase else STEP_STALLED

    @property
    def step_phase_label(self) -> str:
        """The stuck training phase as a label value (`unknown` when not known), sanitised as in `reason`."""
        return re.sub(r"[^A-Za-z0-9_]", "_", self.step_phase[:200]) if self.step_phase else "unknown"

    @property
    def message(self) -> str:
        """Human-readable, with the numbers: how long since progress and how long the phase has run."""
        idle, since = _duration(self.seconds_since_progress), iso(self.last_progress)
        limit = "startupTimeoutSeconds" if self.startup else "stallTimeoutSeconds"
        head = f"no step completed for {idle} (since {since}; {limit}={self.timeout_seconds})"
        if self.startup:
            head += "; the attempt has completed no step yet (start-up)"
        if not self.scraped:
            return f"{head}; trainer metrics unavailable, phase in progress unknown"
        if self.step_phase is None:
            return f"{head}; no phase in progress (the driver is between phases)"
        if self.step_phase_running_seconds is None:
            return f"{head}; phase {self.step_phase} in progress"
        return f"{head}; phase {self.step_phase} running for {_duration(self.step_phase_running_seconds)}"


def detect_stall(
    monitoring: MonitoringSpec,
    metrics: ScrapedMetrics | None,
    attempt_started: datetime,
    last_step_time: datetime | None,
    now: datetime,
) -> Stall | None:
    """The stall of a running job, or None when it is making progress (or has not yet had time to).

    Progress is the latest of: the start of the current attempt (`attempt_started`: a restart resets
    the clock), `last_step_time` (the previous status' lastStepTime, known even when the trainer cannot
    be scraped) and the trainer's own `rlhf_last_step_completed_timestamp_seconds`. The job is stalled
    when more than the timeout in force have passed since then: `monitoring.startupTimeoutSeconds` (when
    set) while the attempt has completed no step (`in_startup`), `stallTimeoutSeconds` after. `metrics` is None when the
    trainer could not be scraped: that alone is no stall before the timeout (it is MetricsUnavailable),
    and a stall after it with the phase unknown. A completed step moves progress forward, so a stall
    clears on the first reconcile that sees it. All datetimes are timezone-aware.
    """
    progress = attempt_started
    if last_step_time is not None:
        progress = max(progress, last_step_time)
    if metrics is not None and metrics.last_step_completed_ts:
        progress = max(progress, datetime.fromtimestamp(metrics.last_step_completed_ts, UTC))
    idle = (now - progress).total_seconds()
    startup = in_startup(metrics, attempt_started, last_step_time)
    timeout = monitoring.timeout_in_force(first_step_done=not startup)
    if idle <= timeout:
        return None
    step_phase = metrics.in_progress_step_phase if metrics is not None else None
    running: float | None = None
    if metrics is not None and step_phase is not None and metrics.in_progress_since:
        running = max(0.0, now.timestamp() - metrics.in_progress_since)
    return Stall(
        step_phase=step_phase,
        seconds_since_progress=idle,
        step_phase_running_seconds=running,
        timeout_seconds=timeout,
        last_progress=progress,
        scraped=metrics is not None,
        startup=startup and monitoring.startup_timeout_seconds is not None,
    )


def in_startup(
    metrics: ScrapedMetrics | None, attempt_started: datetime, last_step_time: datetime | None
) -> bool:
    """Whether the running attempt has completed no step yet. Scraped, the trainer says so: its last step
    is no later than its driver's start (`rlhf_driver_started_timestamp_seconds`), which also holds for
    a restarted attempt while the stopped one's late steps are still in the status. Unscraped (or a
    trainer without that series): no step known after the attempt began."""
    if metrics is not None and metrics.driver_started_ts:
        return (
            not metrics.last_step_completed_ts or metrics.last_step_completed_ts <= metrics.driver_started_ts
        )
    return last_step_time is None or last_step_time <= attempt_started


def set_stalled_condition(
    conditions: list[dict[str, Any]], stall: Stall | None, now: datetime, generation: int | None = None
) -> list[dict[str, Any]]:
    """`conditions` with the `Stalled` condition for `stall` (a new list; the input is not changed).

    A stall sets Stalled=True with its reason and message. While the same stall lasts (same reason),
    the condition is left as first written, so the status is not re-patched every reconcile just
    because the durations in the message grew. No stall sets Stalled=False (reason `Progressing`) if
    the condition exists, and adds nothing to a job that never stalled.
    """
    current = next((c for c in conditions if c.get("type") == CONDITION_TYPE), None)
    if stall is None:
        if current is None:
            return [dict(c) for c in conditions]
        message = "a step completed within stallTimeoutSeconds"
        return set_condition(conditions, CONDITION_TYPE, False, NOT_STALLED, message, now, generation)
    if current is not None and current.get("status") == "True" and current.get("reason") == stall.reason:
        return [dict(c) for c in conditions]
    return set_condition(conditions, CONDITION_TYPE, True, stall.reason, stall.message, now, generation)


def _duration(seconds: float) -> str:
    """`95s`, `31m05s`, `2h03m`: short and exact enough for an Event."""
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"
