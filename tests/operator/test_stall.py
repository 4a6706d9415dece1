"""Stall detection (seed problem 5): the verdict, the condition, and what `decide` does with it."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from rlhf_api.spec import MonitoringSpec
from rlhf_operator.actions import StopRayJob
from rlhf_operator.conditions import iso
from rlhf_operator.scrape import ScrapedMetrics
from rlhf_operator.stall import STEP_STALLED, Stall, detect_stall, set_stalled_condition
from rlhf_operator.status import decide, status_patch
from testkit.status_inputs import NOW, SID, job, obs, ray, running_job

pytestmark = pytest.mark.unit

MON = MonitoringSpec(stallTimeoutSeconds=600)


def stuck_in(phase: str, since: datetime, last_step: datetime | None, steps: int = 4) -> ScrapedMetrics:
    return ScrapedMetrics(
        steps_completed=steps,
        total_steps=20,
        last_step_completed_ts=last_step.timestamp() if last_step else None,
        in_progress_step_phase=phase,
        in_progress_since=since.timestamp(),
        step_phase_seconds={"generation": 3.0, "reward": 1.0},
    )


def test_no_stall_within_the_timeout() -> None:
    m = stuck_in("reward", NOW - timedelta(seconds=500), NOW - timedelta(seconds=590))
    assert detect_stall(MON, m, NOW - timedelta(hours=2), None, NOW) is None


def test_stall_names_the_phase_and_how_long_it_ran() -> None:
    m = stuck_in("reward", NOW - timedelta(seconds=7 * 3600), NOW - timedelta(seconds=7 * 3600 + 5))
    stall = detect_stall(MON, m, NOW - timedelta(hours=8), None, NOW)
    assert stall is not None
    assert stall.reason == "PhaseStuck:reward"
    assert stall.step_phase_running_seconds == pytest.approx(7 * 3600)
    assert "phase reward running for 7h00m" in stall.message
    assert "stallTimeoutSeconds=600" in stall.message


def test_restart_resets_the_clock() -> None:
    # The previous attempt's last step is old, but this attempt started 100 s ago.
    assert detect_stall(MON, None, NOW - timedelta(seconds=100), NOW - timedelta(hours=3), NOW) is None


def test_unreachable_trainer_stalls_with_the_phase_unknown() -> None:
    stall = detect_stall(MON, None, NOW - timedelta(hours=1), NOW - timedelta(seconds=900), NOW)
    assert stall is not None and stall.reason == STEP_STALLED and not stall.scraped
    assert "metrics unavailable" in stall.message


def test_condition_is_written_once_per_stall_and_cleared_by_progress() -> None:
    m = stuck_in("reward", NOW - timedelta(hours=1), NOW - timedelta(hours=1))
    stall = detect_stall(MON, m, NOW - timedelta(hours=2), None, NOW)
    first = set_stalled_condition([], stall, NOW)
    (cond,) = first
    assert cond["status"] == "True" and cond["reason"] == "PhaseStuck:reward"
    # Ten minutes later the same stall does not rewrite the message (no patch storm).
    later = detect_stall(MON, m, NOW - timedelta(hours=2), None, NOW + timedelta(minutes=10))
    assert set_stalled_condition(first, later, NOW + timedelta(minutes=10)) == first
    cleared = set_stalled_condition(first, None, NOW + timedelta(minutes=11))
    assert cleared[0]["status"] == "False" and cleared[0]["reason"] == "Progressing"
    assert set_stalled_condition([], None, NOW) == []


def running(on_stall: str, restarts: int = 0, phase: str = "Running") -> Any:
    """A running job stuck for hours, taking no stack snapshot (tests/operator/test_operator_diagnosis.py
    is about those)."""
    return running_job(on_stall, restarts=restarts, phase=phase)


def stuck_metrics() -> ScrapedMetrics:
    return stuck_in("reward", NOW - timedelta(hours=7), NOW - timedelta(hours=7))


def test_alert_policy_sets_phase_stalled_with_an_event_naming_the_phase() -> None:
    d = decide(running("Alert"), obs(ray_job=ray("RUNNING"), metrics=stuck_metrics()), SID)
    assert d.status["phase"] == "Stalled"
    assert "PhaseStuck:reward" in d.status["message"]
    assert any(t == "Warning" and r == "Stalled" and "reward" in m for t, r, m in d.events)
    assert "stop" not in d.action_kinds
    cond = next(c for c in d.status["conditions"] if c["type"] == "Stalled")
    assert cond["status"] == "True" and cond["reason"] == "PhaseStuck:reward"
    # The handler counts the stall by its phase from this typed verdict, not from the Event's text.
    assert d.new_stall is not None and d.new_stall.step_phase_label == "reward"


def test_a_stall_of_unknown_phase_is_labelled_unknown() -> None:
    d = decide(running("Alert"), obs(ray_job=ray("RUNNING"), metrics_error="connection refused"), SID)
    assert d.new_stall is not None and d.new_stall.step_phase is None
    assert (d.new_stall.reason, d.new_stall.step_phase_label) == (STEP_STALLED, "unknown")
    weird = Stall("re ward/x", 700.0, 5.0, 600, NOW, True)
    assert weird.reason == "PhaseStuck:re_ward_x" and weird.step_phase_label == "re_ward_x"


def test_restart_policy_stops_the_stuck_attempt_and_restarts() -> None:
    d = decide(running("Restart", restarts=1), obs(ray_job=ray("RUNNING"), metrics=stuck_metrics()), SID)
    assert d.status["phase"] == "Restarting"
    assert d.status["restarts"] == 2
    assert StopRayJob(SID) in d.actions
    assert "submissionId" not in d.status


def test_restart_policy_fails_after_the_backoff_limit() -> None:
    j = running("Restart", restarts=3)
    d = decide(j, obs(ray_job=ray("RUNNING"), metrics=stuck_metrics()), SID)
    assert d.status["phase"] == "Failed"
    assert any(
        c["type"] == "Failed" and c["reason"] == "StalledBackoffLimitExceeded" for c in d.status["conditions"]
    )
    assert "delete_cluster" in d.action_kinds and "stop" in d.action_kinds


def test_progress_clears_a_stall() -> None:
    j = running("Alert", phase="Stalled")
    fresh = stuck_in("generation", NOW - timedelta(seconds=5), NOW - timedelta(seconds=10), steps=5)
    d = decide(j, obs(ray_job=ray("RUNNING"), metrics=fresh), SID)
    assert d.status["phase"] == "Running"
    assert ("Normal", "StallCleared", "step 5 completed: no longer stalled") in d.events


def test_timestamps_are_timezone_aware() -> None:
    stall = detect_stall(MON, None, datetime(2026, 1, 1, tzinfo=UTC), None, datetime(2026, 1, 2, tzinfo=UTC))
    assert stall is not None and stall.last_progress.tzinfo is not None


def test_a_lasting_stall_does_not_rewrite_the_status() -> None:
    first = decide(running("Alert"), obs(ray_job=ray("RUNNING"), metrics=stuck_metrics()), SID).status
    later_job = job(first)
    doc = later_job.model_dump(by_alias=True, exclude_none=True, mode="json")
    doc["spec"]["monitoring"].update(stallTimeoutSeconds=600, onStall="Alert", stackSnapshotTimeoutSeconds=0)
    later = decide(
        type(later_job).model_validate(doc),
        obs(ray_job=ray("RUNNING"), metrics=stuck_metrics(), now=NOW + timedelta(minutes=5)),
        SID,
    )
    assert later.status["message"] == first["message"]
    assert later.status["conditions"] == first["conditions"]
    assert not later.events and later.new_stall is None


def test_an_onstall_restart_keeps_the_stall_open_until_a_later_step_completes() -> None:
    """status.openStall (and rlhf_operator_job_stalled_since_timestamp_seconds, and so the stall alert)
    outlives the stopped trainer: it is closed by the restarted attempt's first new step, not by the
    restart."""
    stalled = decide(
        running("Restart", restarts=0), obs(ray_job=ray("RUNNING"), metrics=stuck_metrics()), SID
    )
    assert stalled.status["phase"] == "Restarting"
    assert stalled.status["openStall"] == {
        "phase": "reward",
        "step": 4,
        "since": iso(NOW - timedelta(hours=7)),
    }
    later = NOW + timedelta(seconds=30)
    restarting = job({**stalled.status, "step": 4})
    sid1 = SID[:-1] + "1"
    # The new attempt runs, announcing the checkpoint's step 4 before its first step: still open.
    fresh = stuck_in("generation", later - timedelta(seconds=5), later - timedelta(seconds=20), steps=4)
    again = decide(restarting, obs(now=later, ray_job=ray("RUNNING", sid=sid1), metrics=fresh), sid1)
    assert again.status["phase"] == "Running" and again.status["openStall"]["phase"] == "reward"
    # Step 5 completes: the stall is over.
    done = stuck_in("generation", later - timedelta(seconds=2), later - timedelta(seconds=1), steps=5)
    over = decide(job(again.status), obs(now=later, ray_job=ray("RUNNING", sid=sid1), metrics=done), sid1)
    assert "openStall" not in over.status
    assert status_patch(again.status, over.status)["openStall"] is None  # the merge patch deletes it


# ---- start-up: monitoring.startupTimeoutSeconds holds until the attempt's first step, read through the
# trainer's own exporter and the operator's parser (the two sides of the contract).

STARTUP = MonitoringSpec(stallTimeoutSeconds=60, startupTimeoutSeconds=600)


def _scraped(m: Any) -> ScrapedMetrics:
    from prometheus_client import generate_latest
    from rlhf_operator.scrape import parse_metrics

    return parse_metrics(generate_latest(m.registry).decode(), "j")


def _driver(started: datetime, mon: MonitoringSpec = STARTUP) -> Any:
    from prometheus_client import CollectorRegistry
    from rlhf_trainer.metrics import TrainerExporter

    m = TrainerExporter("j", CollectorRegistry())
    m.driver_started(mon, at=started.timestamp())
    return m


def test_start_up_is_held_to_the_startup_timeout_then_steps_to_the_stall_timeout() -> None:
    now = datetime.now(UTC)
    started = now - timedelta(seconds=300)
    m = _driver(started)
    scraped = _scraped(m)
    # The trainer exports the timeout in force (the alert rule's threshold) and its start.
    assert scraped.stall_timeout_seconds == 600 and scraped.driver_started_ts == started.timestamp()
    # 300 s into start-up: past stallTimeoutSeconds, within startupTimeoutSeconds.
    assert detect_stall(STARTUP, scraped, started, None, now) is None
    stall = detect_stall(STARTUP, scraped, started, None, now + timedelta(seconds=301))
    assert stall is not None and stall.startup and stall.timeout_seconds == 600, stall
    assert "startupTimeoutSeconds=600" in stall.message and "start-up" in stall.message
    # The first step ends start-up: from then on, 60 s without a step is a stall.
    m.step_done({"generation": 1.0}, 1.0)
    scraped = _scraped(m)
    assert scraped.stall_timeout_seconds == 60
    assert detect_stall(STARTUP, scraped, started, None, datetime.now(UTC) + timedelta(seconds=30)) is None
    stall = detect_stall(STARTUP, scraped, started, None, datetime.now(UTC) + timedelta(seconds=61))
    assert stall is not None and not stall.startup and "stallTimeoutSeconds=60" in stall.message


def test_without_a_startup_timeout_start_up_is_held_to_the_stall_timeout() -> None:
    now = datetime.now(UTC)
    mon = MonitoringSpec(stallTimeoutSeconds=60)
    m = _driver(now - timedelta(seconds=61), mon)
    assert _scraped(m).stall_timeout_seconds == 60
    stall = detect_stall(mon, _scraped(m), now - timedelta(seconds=61), None, now)
    assert stall is not None and not stall.startup and "stallTimeoutSeconds=60" in stall.message


def test_a_restarted_attempt_is_in_start_up_though_the_stopped_one_completed_a_late_step() -> None:
    """The stopped attempt finishes its step after the restart began (it stops at a step boundary), so
    the status' lastStepTime is later than the restart; the new driver has completed nothing."""
    now = datetime.now(UTC)
    restarted = now - timedelta(seconds=200)
    late_step = restarted + timedelta(seconds=10)
    m = _driver(restarted + timedelta(seconds=20))
    assert detect_stall(STARTUP, _scraped(m), restarted, late_step, now) is None
    # Unscraped, the status alone: a step after the restart began reads as the attempt's.
    stall = detect_stall(STARTUP, None, restarted, late_step, now)
    assert stall is not None and not stall.startup
    assert detect_stall(STARTUP, None, restarted, restarted - timedelta(seconds=5), now) is None
