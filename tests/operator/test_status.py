"""(RayCluster, Ray job, metrics) -> status and actions, as a pure function."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from rlhf_operator import manifests
from rlhf_operator.actions import StopRayJob, SubmitTrainer
from rlhf_operator.conditions import iso
from rlhf_operator.scrape import ScrapedMetrics, parse_metrics
from rlhf_operator.status import decide, status_patch
from testkit.status_inputs import NOW, SID, job, obs, ray, raycluster_in

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]


def test_missing_cluster_is_created() -> None:
    d = decide(job(), obs(raycluster=None), SID)
    assert d.action_kinds == ["create_cluster"]
    assert d.status["phase"] == "Pending"


def test_unready_cluster_is_provisioning_with_kuberay_reason() -> None:
    failure = [
        {"type": "ReplicaFailure", "status": "True", "reason": "FailedCreateWorkerPod", "message": "quota"}
    ]
    d = decide(job({"phase": "Provisioning"}), obs(raycluster=raycluster_in(None, conditions=failure)), SID)
    assert d.status["phase"] == "Provisioning"
    assert "FailedCreateWorkerPod" in d.status["message"] and "quota" in d.status["message"]
    assert "submit" not in d.action_kinds


def test_ready_cluster_without_job_submits_the_attempts_id() -> None:
    d = decide(job({"phase": "Provisioning"}), obs(), SID)
    assert d.action_kinds == ["submit"]
    assert d.find(SubmitTrainer) == SubmitTrainer(SID)
    assert d.status["submissionId"] == SID


def test_running_job_sets_start_time_and_an_event() -> None:
    d = decide(job({"phase": "Provisioning"}), obs(ray_job=ray("RUNNING"), metrics_error="refused"), SID)
    assert d.status["phase"] == "Running"
    assert d.status["startTime"] == iso(NOW)
    assert ("Normal", "Running", f"trainer job {SID} is running") in d.events
    metrics_cond = next(c for c in d.status["conditions"] if c["type"] == "MetricsUnavailable")
    assert metrics_cond["status"] == "True" and "refused" in metrics_cond["message"]


def test_metrics_fill_the_status() -> None:
    m = ScrapedMetrics(
        steps_completed=2,
        total_steps=3,
        last_step_completed_ts=NOW.timestamp(),
        step_phase_seconds={"generation": 6.0, "reward": 1.0, "actor_train": 3.0},
        engines={"ready": 1},
    )
    d = decide(job({"phase": "Running", "startTime": iso(NOW)}), obs(ray_job=ray("RUNNING"), metrics=m), SID)
    st = d.status
    assert (st["step"], st["totalSteps"], st["progress"]) == (2, 3, "2/3")
    assert st["generationShare"] == 0.6
    assert st["phaseSeconds"]["generation"] == 6.0
    assert st["rollout"]["readyEngines"] == 1
    assert st["lastStepTime"] == iso(NOW)


def test_driver_start_before_the_first_step_is_not_a_last_step_time() -> None:
    """Before step 1 the trainer's last-step timestamp holds its start time (for the stall alert)."""
    m = ScrapedMetrics(steps_completed=0, total_steps=3, last_step_completed_ts=NOW.timestamp())
    d = decide(job({"phase": "Running", "startTime": iso(NOW)}), obs(ray_job=ray("RUNNING"), metrics=m), SID)
    assert "lastStepTime" not in d.status and d.status["step"] == 0


def test_a_resumed_attempt_keeps_the_last_real_step_time() -> None:
    """A resumed trainer reports step N (from its checkpoint) with its own start as the timestamp."""
    earlier = iso(NOW - timedelta(minutes=5))
    m = ScrapedMetrics(steps_completed=2, total_steps=3, last_step_completed_ts=NOW.timestamp())
    current = {"phase": "Running", "startTime": earlier, "step": 2, "lastStepTime": earlier}
    d = decide(job(current), obs(ray_job=ray("RUNNING"), metrics=m), SID)
    assert d.status["lastStepTime"] == earlier


def test_the_evaluation_splits_reward_reaches_status_only_once_reported() -> None:
    """spec.evaluation: the trainer's eval gauges (absent before the first evaluation) into status."""
    running = {"phase": "Running", "startTime": iso(NOW), "step": 4}
    before = ScrapedMetrics(steps_completed=4, total_steps=10, last_step_completed_ts=NOW.timestamp())
    st = decide(job(running), obs(ray_job=ray("RUNNING"), metrics=before), SID).status
    assert not {"evalRewardMean", "evalRewardMeanByDataSource", "evalStep"} & set(st)
    m = ScrapedMetrics(
        steps_completed=4,
        total_steps=10,
        last_step_completed_ts=NOW.timestamp(),
        eval_reward_mean=0.43219,
        eval_reward_mean_by_data_source={"short": 0.5, "long": float("nan"), "gsm8k": 0.36438},
        eval_step=4,
    )
    st = decide(job(running), obs(ray_job=ray("RUNNING"), metrics=m), SID).status
    assert st["evalRewardMean"] == 0.4322
    assert st["evalRewardMeanByDataSource"] == {"gsm8k": 0.3644, "short": 0.5}  # NaN is not written
    assert st["evalStep"] == 4


def test_the_agents_last_step_reaches_status_once_a_step_reported_it() -> None:
    """rollout.agent: turns per episode, tool calls, errors and seconds of the last step into status.agent."""
    running = {"phase": "Running", "startTime": iso(NOW), "step": 0}
    figures = {"agent_turns_per_episode": 1.8333, "agent_tool_calls": 22.0, "agent_tool_errors": 1.0,
               "agent_tool_seconds": 0.25049}  # fmt: skip
    before = ScrapedMetrics(
        steps_completed=0, total_steps=10, last_step_completed_ts=NOW.timestamp(), **figures
    )
    assert "agent" not in decide(job(running), obs(ray_job=ray("RUNNING"), metrics=before), SID).status
    m = ScrapedMetrics(steps_completed=3, total_steps=10, last_step_completed_ts=NOW.timestamp(), **figures)
    st = decide(job(running), obs(ray_job=ray("RUNNING"), metrics=m), SID).status
    assert st["agent"] == {"turnsPerEpisode": 1.833, "toolCalls": 22, "toolErrors": 1, "toolSeconds": 0.25}
    plain = ScrapedMetrics(steps_completed=3, total_steps=10, last_step_completed_ts=NOW.timestamp())
    assert "agent" not in decide(job(running), obs(ray_job=ray("RUNNING"), metrics=plain), SID).status


def test_reward_kl_and_throughput_between_two_observed_steps() -> None:
    before = {
        "phase": "Running",
        "startTime": iso(NOW),
        "step": 2,
        "generatedTokens": 1000,
        "lastStepTime": iso(NOW - timedelta(seconds=20)),
    }
    m = ScrapedMetrics(
        steps_completed=3,
        total_steps=5,
        last_step_completed_ts=NOW.timestamp(),
        generated_tokens_total=1500.0,
        reward_mean=0.61234,
        kl=float("nan"),
        step_phase_seconds={"generation": 4.0},
    )
    st = decide(job(before), obs(ray_job=ray("RUNNING"), metrics=m), SID).status
    assert st["tokensPerSecond"] == 25.0  # 500 tokens over 20 s
    assert st["generatedTokens"] == 1500
    assert st["rewardMean"] == 0.6123
    assert "kl" not in st  # NaN is not written
    # The same step scraped again later (tokens of the next step already counting): nothing moves.
    m2 = ScrapedMetrics(
        steps_completed=3,
        total_steps=5,
        last_step_completed_ts=NOW.timestamp(),
        generated_tokens_total=1700.0,
        step_phase_seconds={"generation": 4.0},
    )
    st2 = decide(job(st), obs(ray_job=ray("RUNNING"), metrics=m2), SID).status
    assert (st2["tokensPerSecond"], st2["generatedTokens"]) == (25.0, 1500)


def test_async_staleness_and_idle_ratios_reach_the_status_once_a_step_completed() -> None:
    before = {"phase": "Running", "startTime": iso(NOW), "step": 0}
    fresh = ScrapedMetrics(steps_completed=0, total_steps=5, trainer_idle_ratio=0.0, rollout_idle_ratio=0.0)
    st = decide(job(before), obs(ray_job=ray("RUNNING"), metrics=fresh), SID).status
    assert "trainerIdleRatio" not in st and "sampleStaleness" not in st  # 0 before a step is not a ratio
    m = ScrapedMetrics(
        steps_completed=4,
        total_steps=5,
        last_step_completed_ts=NOW.timestamp(),
        trainer_idle_ratio=0.08123,
        rollout_idle_ratio=0.31,
        staleness_sum=3.0,
        staleness_count=4.0,
        stale_samples_total=0.0,
        step_phase_seconds={"generation": 0.2, "actor_train": 3.0},
    )
    st = decide(job(before), obs(ray_job=ray("RUNNING"), metrics=m), SID).status
    assert (st["trainerIdleRatio"], st["rolloutIdleRatio"]) == (0.081, 0.31)
    assert st["sampleStaleness"] == 0.75 and st["staleSamples"] == 0


def test_success_releases_the_cluster() -> None:
    d = decide(job({"phase": "Running"}), obs(ray_job=ray("SUCCEEDED")), SID)
    assert d.status["phase"] == "Succeeded"
    assert d.status["completionTime"] == iso(NOW)
    assert (d.status["step"], d.status["progress"]) == (20, "20/20")
    assert "delete_cluster" in d.action_kinds


def test_success_names_where_the_trained_model_was_exported() -> None:
    spec = job().spec
    assert spec.checkpoint.path and spec.checkpoint.export == "onFinish"
    d = decide(job({"phase": "Running"}), obs(ray_job=ray("SUCCEEDED")), SID)
    assert d.status["exportPath"] == spec.checkpoint.path.rstrip("/") + "/model"
    assert d.status["message"].endswith(f"; model exported to {d.status['exportPath']}")
    never = job({"phase": "Running"})
    never = never.model_copy(
        update={
            "spec": never.spec.model_copy(
                update={"checkpoint": never.spec.checkpoint.model_copy(update={"export": "never"})}
            )
        }
    )
    assert "exportPath" not in decide(never, obs(ray_job=ray("SUCCEEDED")), SID).status


def test_failure_restarts_within_backoff_limit_then_fails() -> None:
    d = decide(
        job({"phase": "Running", "restarts": 0}, backoffLimit=1),
        obs(ray_job=ray("FAILED", message="boom")),
        SID,
    )
    assert d.status["phase"] == "Restarting"
    assert d.status["restarts"] == 1
    assert "submissionId" not in d.status
    assert any(e[1] == "Restarting" and "boom" in e[2] for e in d.events)

    d2 = decide(job({"phase": "Running", "restarts": 1}, backoffLimit=1), obs(ray_job=ray("FAILED")), SID)
    assert d2.status["phase"] == "Failed"
    assert "backoffLimit 1 reached" in d2.status["message"]


def test_an_attempt_that_fails_before_it_is_seen_running_is_a_restart_event_of_its_own() -> None:
    """A trainer that crashes at once fails its attempt while the job is still Restarting from the last
    one: the phase does not change, yet it is another restart, with its own Warning Event (which also
    counts rlhf_operator's restarts counter). Found when the lifecycle tests' crash got faster."""
    restarting = {"phase": "Restarting", "restarts": 1, "submissionId": SID}
    d = decide(job(restarting, backoffLimit=3), obs(ray_job=ray("FAILED", message="boom")), SID)
    assert d.status["phase"] == "Restarting" and d.status["restarts"] == 2, d.status
    assert [(t, r) for t, r, _ in d.events] == [("Warning", "Restarting")], d.events
    assert "restart 2/3" in d.events[0][2], d.events


# What Ray's Jobs API says of a driver that exited 2 on bad input: the log's tail, the error last.
INPUT_FAILURE = (
    "Job entrypoint command failed with exit code 2, last available logs (truncated to 20,000 chars):\n"
    "[rlhf] loading the spec\n"
    "error: spec.model.reward.function: cannot import module 'rlhf_no_such_module'\n"
    "  (No module named 'rlhf_no_such_module')\n"
)


def test_bad_input_found_at_run_time_fails_at_once_with_the_drivers_words() -> None:
    d = decide(
        job({"phase": "Running", "restarts": 0}, backoffLimit=3),
        obs(ray_job=ray("FAILED", message=INPUT_FAILURE, exit_code=2)),
        SID,
    )
    assert d.status["phase"] == "Failed", d.status
    assert d.status.get("restarts", 0) == 0
    msg = d.status["message"]
    assert "spec.model.reward.function: cannot import module 'rlhf_no_such_module'" in msg, msg
    assert "No module named" in msg and "Job entrypoint" not in msg and "error:" not in msg, msg
    cond = next(c for c in d.status["conditions"] if c["type"] == "Failed")
    assert cond["reason"] == "InvalidInput"
    assert any(e[0] == "Warning" and "rlhf_no_such_module" in e[2] for e in d.events), d.events
    assert "delete_cluster" in d.action_kinds  # a failed job releases its GPUs


@pytest.mark.parametrize(
    ("status", "code"), [("FAILED", 1), ("FAILED", None), ("STOPPED", None), ("FAILED", 137)]
)
def test_other_failures_still_restart(status: str, code: int | None) -> None:
    d = decide(
        job({"phase": "Running", "restarts": 0}, backoffLimit=3),
        obs(
            ray_job=ray(
                status, message=INPUT_FAILURE.replace("exit code 2", f"exit code {code}"), exit_code=code
            )
        ),
        SID,
    )
    assert d.status["phase"] == "Restarting" and d.status["restarts"] == 1, d.status


def test_suspend_stops_the_trainer_and_suspends_the_cluster() -> None:
    d = decide(job({"phase": "Running"}, suspend=True), obs(ray_job=ray("RUNNING")), SID)
    assert d.status["phase"] == "Suspended"
    assert {"suspend_cluster", "stop"} <= set(d.action_kinds)
    assert StopRayJob(SID) in d.actions


def test_resume_unsuspends_the_cluster() -> None:
    d = decide(job({"phase": "Suspended"}), obs(raycluster=raycluster_in(None, suspend=True)), SID)
    assert "suspend_cluster" in d.action_kinds
    # No longer suspended from this round (its condition says so too), though the trainer does not run yet:
    # Provisioning, so the provisioning timeout and the model fetch are followed again (once a resumed job
    # stayed Suspended until its Ray job was seen running, and a fast crash went Suspended -> Failed).
    assert d.status["phase"] == "Provisioning", d.status
    assert [(t, r) for t, r, _ in d.events] == [("Normal", "Resumed")], d.events
    submitted = decide(job({"phase": "Suspended"}), obs(), SID)
    assert submitted.action_kinds == ["submit"] and submitted.status["phase"] == "Provisioning"


def test_a_resumed_job_whose_pods_never_come_back_meets_its_provisioning_timeout() -> None:
    """docs/api.md: provisioningTimeoutSeconds counts from the unsuspension. A resumed job whose RayCluster
    stays unready (pods unschedulable) fails at the timeout; it once stayed Suspended, where no
    provisioning timeout applied, until its activeDeadline if any."""
    hours_ago = iso(NOW - timedelta(hours=3))
    st = {"phase": "Suspended", "startTime": hours_ago, "step": 5}
    resuming = decide(
        job(st, provisioningTimeoutSeconds=120), obs(raycluster=raycluster_in(None, suspend=True)), SID
    )
    assert resuming.status["phase"] == "Provisioning" and resuming.status["activeSince"] == iso(NOW)
    unready = raycluster_in(None)
    for seconds, phase in ((119, "Provisioning"), (121, "Failed")):
        later = decide(
            job(resuming.status, provisioningTimeoutSeconds=120),
            obs(raycluster=unready, now=NOW + timedelta(seconds=seconds)),
            SID,
        )
        assert later.status["phase"] == phase, (seconds, later.status.get("message"))
    assert "provisioningTimeoutSeconds=120" in later.status["message"], later.status


def test_a_resumed_job_gets_a_whole_stall_timeout_before_its_first_step() -> None:
    """Suspended for hours, then resumed: the new attempt's clock starts at the resume (activeSince), not
    at the first attempt's start or its last step, so its start-up (metrics not served yet) is no stall."""
    hours_ago = iso(NOW - timedelta(hours=3))
    st = {"phase": "Suspended", "startTime": hours_ago, "lastStepTime": hours_ago, "step": 5}
    resuming = decide(job(st), obs(raycluster=raycluster_in(None, suspend=True)), SID)
    assert resuming.status["activeSince"] == iso(NOW), resuming.status
    later = NOW + timedelta(seconds=60)
    d = decide(job(resuming.status), obs(ray_job=ray("RUNNING"), metrics=None, now=later), SID)
    assert d.status["phase"] == "Running", d.status.get("message")
    # Past the stall timeout since the resume with still no step, it is a stall again.
    past = NOW + timedelta(seconds=301)
    stalled = decide(job(d.status), obs(ray_job=ray("RUNNING"), metrics=None, now=past), SID)
    assert stalled.status["phase"] == "Stalled", stalled.status


def test_active_deadline_fails_and_stops() -> None:
    started = iso(NOW - timedelta(seconds=61))
    d = decide(
        job({"phase": "Running", "startTime": started}, activeDeadlineSeconds=60),
        obs(ray_job=ray("RUNNING")),
        SID,
    )
    assert d.status["phase"] == "Failed"
    assert "activeDeadlineSeconds=60" in d.status["message"]
    assert {"stop", "delete_cluster"} <= set(d.action_kinds)


def test_ttl_deletes_a_finished_job_only_after_it_elapses() -> None:
    done = iso(NOW - timedelta(seconds=30))
    early = decide(
        job({"phase": "Succeeded", "completionTime": done}, ttlSecondsAfterFinished=60),
        obs(raycluster=None),
        SID,
    )
    assert "delete_job" not in early.action_kinds
    late = decide(
        job({"phase": "Succeeded", "completionTime": done}, ttlSecondsAfterFinished=10),
        obs(raycluster=None),
        SID,
    )
    assert late.action_kinds == ["delete_job"]


def test_status_patch_holds_only_changes() -> None:
    assert status_patch({"a": 1, "b": 2}, {"a": 1, "b": 3, "c": 4}) == {"b": 3, "c": 4}
    assert status_patch({"a": 1}, {"a": 1}) == {}


def test_last_checkpoint_step_follows_the_trainer_and_survives_its_absence() -> None:
    text = 'rlhf_steps_completed_total{rlhfjob="tiny"} 5\nrlhf_last_checkpoint_step{rlhfjob="tiny"} 4\n'
    running = {"phase": "Running", "startTime": iso(NOW)}
    d = decide(job(running), obs(ray_job=ray("RUNNING"), metrics=parse_metrics(text, "tiny")), SID)
    assert d.status["lastCheckpointStep"] == 4
    # A restarted trainer exports nothing until it resumes: the last known checkpoint stays.
    restarted = parse_metrics('rlhf_steps_completed_total{rlhfjob="tiny"} 0\n', "tiny")
    d = decide(job({**running, "lastCheckpointStep": 4}), obs(ray_job=ray("RUNNING"), metrics=restarted), SID)
    assert d.status["lastCheckpointStep"] == 4
    # A trainer that never checkpointed leaves the field unset.
    d = decide(job(running), obs(ray_job=ray("RUNNING"), metrics=restarted), SID)
    assert "lastCheckpointStep" not in d.status


def test_a_running_jobs_lost_cluster_is_recreated_then_the_same_attempt_resubmitted() -> None:
    """docs/reliability.md: a RayCluster gone under a running job is recreated (Warning ClusterRecreated,
    phase Provisioning); the new head has no trainer job, so the same attempt's id is submitted again
    (the trainer resumes from its checkpoint) and no restart is counted."""
    running = {"phase": "Running", "submissionId": SID, "restarts": 0, "startTime": iso(NOW)}
    gone = decide(job(running), obs(raycluster=None), SID)
    assert gone.action_kinds == ["create_cluster"]
    assert gone.status["phase"] == "Provisioning"
    assert [(t, r) for t, r, _ in gone.events] == [("Warning", "ClusterRecreated")]
    unready = decide(job(gone.status), obs(raycluster=raycluster_in(None)), SID)
    assert unready.status["phase"] == "Provisioning" and unready.action_kinds == []
    ready = decide(job(unready.status), obs(), SID)
    assert ready.actions == (SubmitTrainer(SID),)
    assert ready.status.get("restarts", 0) == 0
    back = decide(job(ready.status), obs(ray_job=ray("RUNNING"), metrics_error="refused"), SID)
    assert back.status["phase"] == "Running" and back.status.get("restarts", 0) == 0


def with_head(pod: str | None) -> dict[str, Any]:
    return raycluster_in(head={"podName": pod} if pod else {})


def test_the_submitted_attempt_records_its_head_pod() -> None:
    d = decide(job({"phase": "Provisioning", "restarts": 0}), obs(raycluster=with_head("tiny-head-a")), SID)
    assert d.action_kinds == ["submit"] and d.status["headPod"] == "tiny-head-a"


@pytest.mark.parametrize(
    ("now_head", "said"),
    [(None, "the Ray head pod tiny-head-a is gone"), ("tiny-head-b", "replaced by tiny-head-b")],
)
def test_a_running_attempts_lost_head_pod_restarts_it_from_the_checkpoint(
    now_head: str | None, said: str
) -> None:
    """docs/reliability.md: the head pod deleted under a running job. KubeRay keeps the RayCluster
    `ready` (kuberay#2161), so the operator reads the head pod's name: another one, or none, means the
    driver and the GCS are gone. Restarting (counted, Warning), never Running on nothing."""
    running = {
        "phase": "Running",
        "submissionId": SID,
        "restarts": 0,
        "startTime": iso(NOW),
        "headPod": "tiny-head-a",
    }
    d = decide(job(running), obs(raycluster=with_head(now_head), ray_job_error="connection refused"), SID)
    assert d.status["phase"] == "Restarting", d.status
    assert d.status["restarts"] == 1 and "submissionId" not in d.status and "headPod" not in d.status
    assert said in d.status["message"] and "driver and the GCS" in d.status["message"]
    assert [(t, r) for t, r, _ in d.events] == [("Warning", "Restarting")]
    # The next attempt is submitted on the new head, and records it.
    nxt = decide(job(d.status), obs(raycluster=with_head("tiny-head-b")), "sid-1")
    assert nxt.actions == (SubmitTrainer("sid-1"),) and nxt.status["headPod"] == "tiny-head-b"


def test_the_same_head_pod_is_no_loss_and_a_job_from_before_the_field_adopts_its_head() -> None:
    running = {
        "phase": "Running",
        "submissionId": SID,
        "restarts": 0,
        "startTime": iso(NOW),
        "headPod": "tiny-head-a",
    }
    same = decide(job(running), obs(raycluster=with_head("tiny-head-a"), ray_job=ray("RUNNING")), SID)
    assert same.status["phase"] == "Running" and same.status["restarts"] == 0
    older = {k: v for k, v in running.items() if k != "headPod"}
    adopted = decide(job(older), obs(raycluster=with_head("tiny-head-a"), ray_job=ray("RUNNING")), SID)
    assert adopted.status["phase"] == "Running" and adopted.status["headPod"] == "tiny-head-a"


def test_a_head_pod_lost_while_provisioning_is_not_a_restart() -> None:
    """Before the attempt runs (the recreated-cluster path) a new head is expected: no restart."""
    prov = {"phase": "Provisioning", "submissionId": SID, "restarts": 0, "headPod": "tiny-head-a"}
    d = decide(job(prov), obs(raycluster=with_head("tiny-head-b")), SID)
    assert d.status["restarts"] == 0 and d.status["phase"] != "Restarting"


def test_the_next_attempt_waits_for_the_previous_one_to_stop() -> None:
    """Never two attempts at once: a stopped attempt finishes its step (and may save) before it exits,
    holding the checkpoint directory and the metrics port; the next is submitted once it has ended."""
    restarted = {"phase": "Restarting", "restarts": 1, "lastRestartTime": iso(NOW - timedelta(seconds=5))}
    previous = "rlhf-ns-tiny-0123abcd-0"
    d = decide(job(restarted), obs(previous_running=previous), SID)
    assert d.action_kinds == [] and previous in d.status["message"]
    assert decide(job(restarted), obs(), SID).action_kinds == ["submit"]
    # Past its grace period and 30 s more, Ray's SIGKILL has failed: go on rather than hang.
    late = {**restarted, "lastRestartTime": iso(NOW - timedelta(seconds=61))}
    assert decide(job(late), obs(previous_running=previous), SID).action_kinds == ["submit"]


def test_after_a_readmission_the_wait_for_the_previous_attempt_counts_from_it_not_an_older_restart() -> None:
    """Restarted an hour ago, then evicted and readmitted 5 s ago: the attempt stopping now is the
    evicted one, so the grace counts from the readmission (activeSince), not from the old restart."""
    readmitted = {
        "phase": "Provisioning",
        "restarts": 1,
        "preemptions": 1,
        "lastRestartTime": iso(NOW - timedelta(hours=1)),
        "activeSince": iso(NOW - timedelta(seconds=5)),
    }
    previous = "rlhf-ns-tiny-0123abcd-1"
    d = decide(job(readmitted), obs(previous_running=previous), SID)
    assert d.action_kinds == [] and previous in d.status["message"], d.status


def test_the_previous_attempt_is_one_restart_or_one_readmission_ago() -> None:
    j, uid = job(), "0123abcd-ffff"
    assert manifests.previous_submission_ids(j, uid, 0, 0) == []
    assert manifests.previous_submission_ids(j, uid, 2, 0) == [manifests.submission_id(j, uid, 1)]
    assert manifests.previous_submission_ids(j, uid, 1, 1) == [
        manifests.submission_id(j, uid, 0, 1),
        manifests.submission_id(j, uid, 1, 0),
    ]


def test_the_export_uploads_progress_reaches_status_from_the_trainers_series() -> None:
    """checkpoint.exportTo: the trainer's rlhf_export_upload_* series (absent before an upload starts), as
    exported by its TrainerExporter and scraped, into status.export; a failure is kept there."""
    from prometheus_client import CollectorRegistry, generate_latest
    from rlhf_trainer.metrics import TrainerExporter

    running = {"phase": "Running", "startTime": iso(NOW), "step": 4}
    base = job(running)
    checkpoint = base.spec.checkpoint.model_copy(update={"export_to": "s3://models/run-1"})
    uploading = base.model_copy(update={"spec": base.spec.model_copy(update={"checkpoint": checkpoint})})
    registry = CollectorRegistry()
    trainer = TrainerExporter("tiny", registry)
    trainer.steps_completed.labels("tiny").inc(4)

    def status_now() -> dict[str, Any]:
        scraped = parse_metrics(generate_latest(registry).decode(), "tiny")
        return decide(uploading, obs(ray_job=ray("RUNNING"), metrics=scraped), SID).status

    assert "export" not in status_now()
    trainer.export_uploading(3 * 2**20, 10 * 2**20, done=False, failed=False)
    assert status_now()["export"] == {
        "uri": "s3://models/run-1",
        "bytesDone": 3 * 2**20,
        "bytesTotal": 10 * 2**20,
        "done": False,
        "failed": False,
    }
    trainer.export_uploading(10 * 2**20, 10 * 2**20, done=True, failed=False)
    assert status_now()["export"]["done"] is True
    trainer.export_uploading(2**20, 10 * 2**20, done=False, failed=True)
    assert status_now()["export"]["failed"] is True
