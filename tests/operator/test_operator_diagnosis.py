"""A stall's stack snapshot, operator side (rlhf_operator.diagnosis and status.decide): asked for once
per stall, waited for across rounds within its limit, an onStall restart held until it is taken or
timed out, its verdict in the Stalled condition and an Event, its dump bounded for the ConfigMap; and
`rlhf diagnose`'s rendering of it."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import pytest
from rlhf_operator import diagnosis
from rlhf_operator.actions import Decision, RecordStacks, StopSnapshot, SubmitSnapshot
from rlhf_operator.conditions import iso
from rlhf_operator.diagnose_cli import render
from rlhf_operator.scrape import ScrapedMetrics
from rlhf_operator.status import decide
from testkit.status_inputs import NOW, SID, obs, ray, running_job

pytestmark = pytest.mark.unit

SINCE = NOW - timedelta(hours=7)
SNAP = {
    "taken_at": iso(NOW),
    "seconds": 6.2,
    "limit_seconds": 5,
    "processes": [
        {
            "who": "actor rank 1",
            "pid": 7,
            "pod": "p",
            "answered": True,
            "where": "in `injected_hang`",
            "work_thread": 1,
            "threads": [
                {"ident": 1, "frames": [{"file": "/a/fault_env.py", "line": 63, "func": "injected_hang"}]}
            ],
        },
        {"who": "rollout engine 0", "pid": 8, "pod": "p", "answered": False, "state": "T (stopped)"},
    ],
    "verdict": [
        "actor rank 1 in `injected_hang` (rlhf_trainer.fault_env:63)",
        "rollout engine 0 did not answer",
    ],
}


def stuck(on_stall: str, status: dict[str, Any] | None = None, snapshot: int = 60) -> Any:
    return running_job(on_stall, snapshot, **(status or {}))


def metrics() -> ScrapedMetrics:
    return ScrapedMetrics(
        steps_completed=4,
        last_step_completed_ts=SINCE.timestamp(),
        in_progress_step_phase="actor_train",
        in_progress_since=SINCE.timestamp(),
    )


def round_(j: Any, later: float = 0.0, **kw: Any) -> Decision:
    return decide(
        j, obs(now=NOW + timedelta(seconds=later), ray_job=ray("RUNNING"), metrics=metrics(), **kw), SID
    )


def test_a_restart_waits_for_the_snapshot_then_carries_its_verdict() -> None:
    first = round_(stuck("Restart"))
    sid = diagnosis.submission_id(SID, SINCE, "PhaseStuck:actor_train")
    assert first.actions == (SubmitSnapshot(sid),)
    assert first.status["phase"] == "Stalled" and "stop" not in first.action_kinds  # not restarted yet
    assert sid.endswith("-actor-train")
    assert first.status["diagnosis"] == {
        "state": "Taking",
        "stallSince": iso(SINCE),
        "reason": "PhaseStuck:actor_train",
        "submissionId": sid,
        "requestedAt": iso(NOW),
    }
    assert first.status["message"].endswith("taking a stack snapshot before the restart")
    # Next round: the snapshot job still runs, within its limit: still waiting, nothing asked again.
    waiting = round_(stuck("Restart", first.status), 10, stacks=diagnosis.SnapshotResult(False))
    assert waiting.action_kinds == [] and waiting.status["diagnosis"]["state"] == "Taking"
    # It ended with a snapshot: the ConfigMap is written, the verdict said, and the attempt restarts.
    done = round_(stuck("Restart", waiting.status), 12, stacks=diagnosis.SnapshotResult(True, SNAP))
    assert done.action_kinds == ["record_stacks", "stop"]
    recorded = done.find(RecordStacks)
    assert recorded is not None and recorded.stacks is SNAP
    assert done.status["phase"] == "Restarting" and done.status["restarts"] == 1
    d = done.status["diagnosis"]
    assert (d["state"], d["seconds"], d["summary"]) == ("Taken", 12.0, " | ".join(SNAP["verdict"]))
    cond = next(c for c in done.status["conditions"] if c["type"] == "Stalled")
    assert (
        cond["message"].endswith("; stacks: " + d["summary"]) and cond["reason"] == "PhaseStuck:actor_train"
    )
    assert ("Warning", "StallDiagnosed", "stacks of 2 processes: " + d["summary"]) in done.events
    assert "injected_hang" in done.status["message"]  # the restart's reason carries the verdict too


def test_a_snapshot_past_its_limit_is_stopped_and_the_restart_goes_on() -> None:
    first = round_(stuck("Restart", snapshot=30))
    late = round_(stuck("Restart", first.status, snapshot=30), 31, stacks=diagnosis.SnapshotResult(False))
    assert late.action_kinds == ["stop_snapshot", "stop"] and late.find(StopSnapshot) == StopSnapshot(
        first.actions[0].submission_id
    )
    assert (
        late.status["diagnosis"]["state"] == "TimedOut"
        and "stackSnapshotTimeoutSeconds=30" in late.status["diagnosis"]["summary"]
    )
    assert late.status["phase"] == "Restarting"
    # Unreadable this round (dashboard down: no result) counts against the same limit.
    blind = round_(stuck("Restart", first.status, snapshot=30), 31, stacks=None)
    assert blind.status["diagnosis"]["state"] == "TimedOut"


def test_a_snapshot_job_without_a_snapshot_fails_the_diagnosis_not_the_job() -> None:
    first = round_(stuck("Alert"))
    failed = round_(
        stuck("Alert", first.status),
        8,
        stacks=diagnosis.SnapshotResult(True, error="its Ray job x ended FAILED: boom"),
    )
    assert failed.status["diagnosis"]["state"] == "Failed" and failed.status["phase"] == "Stalled"
    assert any(r == "StallDiagnosisFailed" and "boom" in m for _, r, m in failed.events)
    # A later round of the same stall asks for nothing again.
    again = round_(stuck("Alert", failed.status), 60)
    assert again.action_kinds == [] and again.status["diagnosis"] == failed.status["diagnosis"]


def test_a_snapshot_the_head_refused_lets_the_restart_go_on() -> None:
    """The handler marks the diagnosis Failed when the Ray head refuses the snapshot job; the next round
    restarts without waiting for it."""
    first = round_(stuck("Restart"))
    refused = {**first.status["diagnosis"], "state": "Failed", "summary": "no stack snapshot: HTTP 500"}
    after = round_(stuck("Restart", {**first.status, "diagnosis": refused}), 3)
    assert after.action_kinds == ["stop"] and after.status["phase"] == "Restarting"
    assert after.status["diagnosis"] == refused


def test_a_stall_that_moves_to_another_phase_gets_a_new_snapshot() -> None:
    """Declared while still in generation (a start-up), then stuck in reward: the first snapshot showed
    the start-up, the second shows the reward."""
    first = round_(stuck("Alert"))
    taken = round_(stuck("Alert", first.status), 8, stacks=diagnosis.SnapshotResult(True, SNAP))
    assert taken.status["diagnosis"]["state"] == "Taken"
    moved = ScrapedMetrics(
        steps_completed=4,
        last_step_completed_ts=SINCE.timestamp(),
        in_progress_step_phase="reward",
        in_progress_since=(NOW + timedelta(seconds=20)).timestamp(),
    )
    j = stuck("Alert", taken.status)
    again = decide(j, obs(now=NOW + timedelta(seconds=30), ray_job=ray("RUNNING"), metrics=moved), SID)
    assert again.action_kinds == ["snapshot"] and again.actions != first.actions
    assert again.status["diagnosis"]["reason"] == "PhaseStuck:reward"
    assert again.status["diagnosis"]["stallSince"] == iso(SINCE)  # the same stall
    cond = next(c for c in again.status["conditions"] if c["type"] == "Stalled")
    assert "; stacks: " not in cond["message"]  # the start-up's verdict is not the reward's


def test_no_snapshot_when_switched_off() -> None:
    d = round_(stuck("Restart", snapshot=0))
    assert d.action_kinds == ["stop"] and "diagnosis" not in d.status and d.status["phase"] == "Restarting"


def test_the_snapshot_is_read_from_the_log_and_bounded_for_the_config_map() -> None:
    log = "actor rank 1 in x\n" + diagnosis.MARKER + json.dumps(SNAP) + "\n"
    assert diagnosis.parse_log(log) == SNAP
    assert diagnosis.parse_log("no marker here\n") is None
    assert diagnosis.parse_log(diagnosis.MARKER + "{not json\n") is None
    big = {
        "processes": [
            {
                "who": f"r{i}",
                "work_thread": 1,
                "threads": [
                    {"ident": 1, "frames": [{"file": "/x" * 50, "line": j, "func": "f"} for j in range(300)]},
                    {"ident": 2, "frames": [{"file": "/y" * 50, "line": j, "func": "g"} for j in range(300)]},
                ],
            }
            for i in range(40)
        ]
    }
    text = diagnosis.bounded_dump(big, 400_000)
    assert len(text.encode()) <= 400_000
    trimmed = json.loads(text)
    assert all(len(p["threads"]) == 1 and len(p["threads"][0]["frames"]) == 40 for p in trimmed["processes"])
    cut = diagnosis.bounded_dump(big, 20_000)
    assert len(cut.encode()) <= 20_000 and cut.rstrip().endswith(")")
    owner = {
        "apiVersion": "rlhf.dev/v1alpha1",
        "kind": "RLHFJob",
        "name": "j",
        "uid": "u",
        "controller": True,
    }
    cm = diagnosis.config_map("j", "ns", owner, "no step completed for 7h", {"seconds": 6.5}, SNAP)
    assert cm["metadata"]["name"] == "j-stacks" and cm["metadata"]["ownerReferences"] == [owner]
    assert cm["data"]["summary.txt"].splitlines()[3:] == SNAP["verdict"]
    assert json.loads(cm["data"]["stacks.json"]) == SNAP


def test_rlhf_diagnose_prints_the_verdict_and_each_process() -> None:
    text = render("job ns/j: snapshot\n", SNAP)
    assert text.splitlines() == [
        "job ns/j: snapshot",
        "",
        "actor rank 1 (pid 7, pod p): in `injected_hang`",
        "    /a/fault_env.py:63 in injected_hang",
        "rollout engine 0 (pid 8, pod p): did not answer (state T (stopped))",
    ]
