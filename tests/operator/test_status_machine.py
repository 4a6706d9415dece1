"""The job phase machine (rlhf_operator.status.decide), one test per transition: from a stored phase and
what the round observes, the next phase and the typed actions. The table's phase changes are the edges
docs/architecture.md draws, and the drawing has no edge without a test here."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from rlhf_api.spec import JOB_PHASES, RLHFJob
from rlhf_operator import kueue
from rlhf_operator.actions import (
    AwaitCreateBackoff,
    CreateCluster,
    Decision,
    DeleteCluster,
    DeleteJob,
    ScaleRolloutGroup,
    SetClusterSuspend,
    StopRayJob,
    SubmitTrainer,
    WriteEngines,
)
from rlhf_operator.conditions import iso
from rlhf_operator.scrape import ScrapedMetrics
from rlhf_operator.status import PHASE_STEPS, decide
from testkit.status_inputs import (
    NOW,
    SID,
    fetch_failed,
    head_pod,
    job,
    obs,
    ray,
    raycluster_in,
    remote_job,
    running_job,
)

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
QUEUE = "research"
AGO = iso(NOW - timedelta(hours=1))


def queued(j: RLHFJob) -> RLHFJob:
    j.metadata.setdefault("labels", {})[kueue.QUEUE_LABEL] = QUEUE
    return j


def kueue_cluster(suspend: bool, state: str | None = "ready") -> dict[str, Any]:
    c = raycluster_in(state, suspend=suspend)
    c["metadata"]["labels"] = {kueue.QUEUE_LABEL: QUEUE}
    return c


def with_rollout_group(c: dict[str, Any], replicas: int) -> dict[str, Any]:
    c["spec"]["workerGroupSpecs"] = [{"groupName": "rollout", "replicas": replicas, "maxReplicas": replicas}]
    return c


def autoscaled(j: RLHFJob, **autoscaling: Any) -> RLHFJob:
    doc = j.model_dump(by_alias=True, exclude_none=True, mode="json")
    doc["spec"]["rollout"]["autoscaling"] = {"enabled": True, **autoscaling}
    return RLHFJob.model_validate(doc)


def stuck(steps: int = 3) -> ScrapedMetrics:
    """The trainer's metrics of a step that has not completed for an hour (past stallTimeoutSeconds)."""
    return ScrapedMetrics(
        steps_completed=steps, total_steps=20, last_step_completed_ts=(NOW - timedelta(hours=1)).timestamp()
    )


@dataclass(frozen=True)
class Case:
    """A transition: `before` (the stored phase) to `after`, with exactly `actions` (kinds, in order)."""

    name: str
    before: str
    after: str
    job: RLHFJob
    observed: dict[str, Any] = field(default_factory=dict)
    actions: tuple[str, ...] = ()


def running(**status: Any) -> dict[str, Any]:
    return {"phase": "Running", "startTime": AGO, "submissionId": SID, "restarts": 0, **status}


CASES = [
    # Finished: the cluster's release and the TTL clock.
    Case("succeeded-releases-cluster", "Succeeded", "Succeeded", job({"phase": "Succeeded", "completionTime": AGO}),
         {}, ("delete_cluster",)),
    Case("failed-ttl-deletes-job", "Failed", "Failed",
         job({"phase": "Failed", "completionTime": AGO}, ttlSecondsAfterFinished=60), {"raycluster": None},
         ("delete_job",)),
    # Holds: suspended, queued, admitted, resumed, deadline.
    Case("running-suspended", "Running", "Suspended", job(running(), suspend=True), {"ray_job": ray("RUNNING")},
         ("suspend_cluster", "stop")),
    Case("queued-job-suspended-deletes-cluster", "Provisioning", "Suspended",
         queued(job({"phase": "Provisioning"}, suspend=True)), {"raycluster": kueue_cluster(False)},
         ("delete_cluster",)),
    Case("pending-queued-by-kueue", "Pending", "Queued", queued(job({"phase": "Pending"})),
         {"raycluster": kueue_cluster(True, state=None)}),
    Case("running-evicted-by-kueue", "Running", "Queued", queued(job(running())),
         {"raycluster": kueue_cluster(True)}, ("stop",)),
    Case("suspended-queued-by-kueue", "Suspended", "Queued", queued(job({"phase": "Suspended"})),
         {"raycluster": kueue_cluster(True, state=None)}),
    Case("queued-admitted", "Queued", "Provisioning", queued(job({"phase": "Queued"})),
         {"raycluster": kueue_cluster(False, state=None)}),
    Case("queued-admitted-submits", "Queued", "Provisioning", queued(job({"phase": "Queued"})),
         {"raycluster": kueue_cluster(False)}, ("submit",)),
    Case("suspended-resumed-recreates-cluster", "Suspended", "Pending", job({"phase": "Suspended"}),
         {"raycluster": None}, ("create_cluster",)),
    Case("suspended-unsuspends-its-cluster", "Suspended", "Provisioning", job({"phase": "Suspended"}),
         {"raycluster": raycluster_in(None, suspend=True)}, ("suspend_cluster",)),
    Case("suspended-resumed-submits", "Suspended", "Provisioning", job({"phase": "Suspended"}), {}, ("submit",)),
    Case("suspended-resumed-attempt-runs", "Suspended", "Running", job({"phase": "Suspended"}),
         {"ray_job": ray("RUNNING")}),
    Case("provisioning-deadline-fails", "Provisioning", "Failed",
         job({"phase": "Provisioning", "activeSince": AGO}, activeDeadlineSeconds=60),
         {"raycluster": raycluster_in(None)}, ("delete_cluster",)),
    Case("running-deadline-fails", "Running", "Failed", job(running(activeSince=AGO), activeDeadlineSeconds=60),
         {"ray_job": ray("RUNNING")}, ("stop", "delete_cluster")),
    # Starting: Pending, Provisioning, Restarting.
    Case("pending-creates-cluster", "Pending", "Pending", job(), {"raycluster": None}, ("create_cluster",)),
    Case("pending-create-backing-off", "Pending", "Pending", job(), {"raycluster": None, "create_backoff": True},
         ("await_create_backoff",)),
    Case("pending-cluster-not-ready", "Pending", "Provisioning", job({"phase": "Pending"}),
         {"raycluster": raycluster_in(None)}),
    Case("restarting-cluster-not-ready", "Restarting", "Restarting", job({"phase": "Restarting", "restarts": 1}),
         {"raycluster": raycluster_in(None)}),
    Case("provisioning-timeout-restarts", "Provisioning", "Restarting",
         job({"phase": "Provisioning", "activeSince": AGO}, provisioningTimeoutSeconds=60,
             onProvisioningTimeout="Restart"),
         {"raycluster": raycluster_in(None)}, ("delete_cluster",)),
    Case("provisioning-timeout-fails", "Provisioning", "Failed",
         job({"phase": "Provisioning", "activeSince": AGO}, provisioningTimeoutSeconds=60),
         {"raycluster": raycluster_in(None)}, ("delete_cluster",)),
    Case("pending-submits", "Pending", "Provisioning", job({"phase": "Pending"}), {}, ("submit",)),
    Case("provisioning-dashboard-unreachable", "Provisioning", "Provisioning", job({"phase": "Provisioning"}),
         {"ray_job_error": "connection refused"}),
    Case("restarting-waits-for-previous-attempt", "Restarting", "Restarting",
         job({"phase": "Restarting", "restarts": 1, "lastRestartTime": iso(NOW)}),
         {"previous_running": "rlhf-ns-tiny-0123abcd-0"}),
    Case("provisioning-ray-job-pending", "Provisioning", "Provisioning", job({"phase": "Provisioning"}),
         {"ray_job": ray("PENDING")}),
    Case("provisioning-runs", "Provisioning", "Running", job({"phase": "Provisioning"}), {"ray_job": ray("RUNNING")}),
    Case("pending-runs", "Pending", "Running", job({"phase": "Pending"}), {"ray_job": ray("RUNNING")}),
    Case("restarting-runs", "Restarting", "Running", job({"phase": "Restarting", "restarts": 1}),
         {"ray_job": ray("RUNNING")}),
    Case("provisioning-succeeds", "Provisioning", "Succeeded", job({"phase": "Provisioning"}),
         {"ray_job": ray("SUCCEEDED")}, ("delete_cluster",)),
    Case("restarting-attempt-fails-again", "Restarting", "Restarting", job({"phase": "Restarting", "restarts": 1}),
         {"ray_job": ray("FAILED", message="boom")}),
    # Running and Stalled.
    Case("running-cluster-gone-recreated", "Running", "Provisioning", job(running()), {"raycluster": None},
         ("create_cluster",)),
    Case("running-head-lost-restarts", "Running", "Restarting", job(running(headPod="tiny-head-a")),
         {"raycluster": raycluster_in(head={"podName": "tiny-head-b"})}),
    Case("running-ray-job-failed-restarts", "Running", "Restarting", job(running()),
         {"ray_job": ray("FAILED", message="boom")}),
    Case("running-backoff-limit-fails", "Running", "Failed", job(running(restarts=3), backoffLimit=3),
         {"ray_job": ray("STOPPED")}, ("delete_cluster",)),
    Case("running-bad-input-fails", "Running", "Failed", job(running()),
         {"ray_job": ray("FAILED", message="error: no such model", exit_code=2)}, ("delete_cluster",)),
    Case("running-succeeds", "Running", "Succeeded", job(running()), {"ray_job": ray("SUCCEEDED")},
         ("delete_cluster",)),
    Case("running-stays-running", "Running", "Running", job(running()),
         {"ray_job": ray("RUNNING"), "metrics": ScrapedMetrics(steps_completed=1, total_steps=20,
                                                               last_step_completed_ts=NOW.timestamp())}),
    Case("running-stalls", "Running", "Stalled", running_job("Alert", startTime=AGO),
         {"ray_job": ray("RUNNING"), "metrics": stuck()}),
    Case("running-stall-restarts", "Running", "Restarting", running_job("Restart", startTime=AGO),
         {"ray_job": ray("RUNNING"), "metrics": stuck()}, ("stop",)),
    Case("stalled-stall-restarts", "Stalled", "Restarting", running_job("Restart", phase="Stalled", startTime=AGO),
         {"ray_job": ray("RUNNING"), "metrics": stuck()}, ("stop",)),
    Case("stalled-step-completes", "Stalled", "Running", running_job("Alert", phase="Stalled", step=3),
         {"ray_job": ray("RUNNING"), "metrics": ScrapedMetrics(steps_completed=4, total_steps=20,
                                                               last_step_completed_ts=NOW.timestamp())}),
    Case("stalled-head-lost-restarts", "Stalled", "Restarting", job(running(phase="Stalled", headPod="tiny-head-a")),
         {"raycluster": raycluster_in(head={})}),
    Case("stalled-suspended", "Stalled", "Suspended", job(running(phase="Stalled"), suspend=True),
         {"ray_job": ray("RUNNING")}, ("suspend_cluster", "stop")),
    Case("pending-suspended", "Pending", "Suspended", job({"phase": "Pending"}, suspend=True),
         {"raycluster": raycluster_in(None)}, ("suspend_cluster",)),
    Case("restarting-suspended", "Restarting", "Suspended", job({"phase": "Restarting"}, suspend=True),
         {"raycluster": raycluster_in(None)}, ("suspend_cluster",)),
    Case("queued-suspended", "Queued", "Suspended", queued(job({"phase": "Queued"}, suspend=True)),
         {"raycluster": kueue_cluster(True, state=None)}, ("delete_cluster",)),
    Case("provisioning-evicted-by-kueue", "Provisioning", "Queued",
         queued(job({"phase": "Provisioning", "submissionId": SID})), {"raycluster": kueue_cluster(True)},
         ("stop",)),
    Case("restarting-evicted-by-kueue", "Restarting", "Queued",
         queued(job({"phase": "Restarting", "conditions": [
             {"type": "Queued", "status": "False", "reason": "Admitted", "message": "", "lastTransitionTime": AGO}
         ]})), {"raycluster": kueue_cluster(True)}),
    Case("stalled-evicted-by-kueue", "Stalled", "Queued", queued(job(running(phase="Stalled"))),
         {"raycluster": kueue_cluster(True)}, ("stop",)),
    Case("pending-deadline-fails", "Pending", "Failed", job({"phase": "Pending", "activeSince": AGO},
         activeDeadlineSeconds=60), {"raycluster": None}),
    Case("restarting-timeout-past-backoff-fails", "Restarting", "Failed",
         job({"phase": "Restarting", "restarts": 1, "activeSince": AGO, "lastRestartTime": AGO},
             provisioningTimeoutSeconds=60, onProvisioningTimeout="Restart", backoffLimit=1),
         {"raycluster": raycluster_in(None)}, ("delete_cluster",)),
    Case("pending-timeout-restarts", "Pending", "Restarting",
         job({"phase": "Pending", "activeSince": AGO}, provisioningTimeoutSeconds=60,
             onProvisioningTimeout="Restart"), {"raycluster": raycluster_in(None)}, ("delete_cluster",)),
    Case("stalled-past-backoff-fails", "Stalled", "Failed",
         running_job("Restart", phase="Stalled", startTime=AGO, restarts=3),
         {"ray_job": ray("RUNNING"), "metrics": stuck()}, ("stop", "delete_cluster")),
    Case("restarting-succeeds", "Restarting", "Succeeded", job({"phase": "Restarting", "restarts": 1}),
         {"ray_job": ray("SUCCEEDED")}, ("delete_cluster",)),
    Case("stalled-succeeds", "Stalled", "Succeeded", job(running(phase="Stalled")), {"ray_job": ray("SUCCEEDED")},
         ("delete_cluster",)),
    Case("stalled-cluster-gone-recreated", "Stalled", "Provisioning", job(running(phase="Stalled")),
         {"raycluster": None}, ("create_cluster",)),
    # Remote models: the head's fetch step failed for good (tests/operator/test_model_fetch.py).
    Case("provisioning-model-not-found-fails", "Provisioning", "Failed", remote_job({"phase": "Provisioning"}),
         {"raycluster": raycluster_in("unknown"), "pods": [head_pod(fetch_failed("ModelNotFound"))]}, ("delete_cluster",)),
    Case("restarting-credentials-refused-fails", "Restarting", "Failed",
         remote_job({"phase": "Restarting", "restarts": 1}),
         {"raycluster": raycluster_in(None), "pods": [head_pod(fetch_failed("CredentialsRefused"))]}, ("delete_cluster",)),
]  # fmt: skip


def round_of(case: Case) -> Decision:
    return decide(case.job, obs(**case.observed), SID)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_transition(case: Case) -> None:
    stored = case.job.status.phase if case.job.status and case.job.status.phase else "Pending"
    assert stored == case.before
    d = round_of(case)
    assert d.status["phase"] == case.after, d.status.get("message")
    assert tuple(d.action_kinds) == case.actions, d.actions


def test_every_phase_has_its_steps_and_every_step_list_ends_in_a_decision() -> None:
    assert set(PHASE_STEPS) == set(JOB_PHASES)
    for phase, steps in PHASE_STEPS.items():
        assert steps, phase
        assert steps[-1].__name__ in ("_attempt", "_finished"), phase


def test_every_drawn_transition_has_a_test_and_every_tested_change_is_drawn() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = re.search(r"```mermaid\n(stateDiagram-v2\n.*?)```", text, re.S)
    assert block is not None, "docs/architecture.md draws no stateDiagram-v2"
    drawn = {(a, b) for a, b in re.findall(r"^\s*(\w+) --> (\w+)", block.group(1), re.M) if a in JOB_PHASES}
    tested = {(c.before, c.after) for c in CASES if c.before != c.after}
    assert drawn - tested == set(), "drawn but not tested"
    assert tested - drawn == set(), "tested but not drawn"


# -------------------------------------------------------------------- typed actions and their inputs


def test_actions_carry_what_they_act_on() -> None:
    d = decide(job({"phase": "Provisioning"}), obs(), SID)
    assert d.actions == (SubmitTrainer(SID),)
    stop = decide(job(running(), suspend=True), obs(ray_job=ray("RUNNING")), SID)
    assert stop.actions == (SetClusterSuspend(True), StopRayJob(SID))
    resumed = decide(job({"phase": "Suspended"}), obs(raycluster=raycluster_in(None, suspend=True)), SID)
    assert resumed.actions == (SetClusterSuspend(False),)
    ttl = decide(job({"phase": "Failed", "completionTime": AGO}, ttlSecondsAfterFinished=0), obs(), SID)
    assert ttl.actions == (DeleteCluster(), DeleteJob())
    assert decide(job(), obs(raycluster=None), SID).actions == (CreateCluster(),)
    backoff = decide(job(running()), obs(raycluster=None, create_backoff=True), SID)
    assert backoff.actions == (AwaitCreateBackoff(),) and backoff.holds_round and backoff.events == ()


def test_a_cluster_patch_in_flight_is_not_sent_again() -> None:
    """Read-your-writes is an input: the suspend patch not yet seen by the watch is not repeated."""
    pending = obs(ray_job=ray("RUNNING"), cluster_patch_pending=True)
    d = decide(job(running(), suspend=True), pending, SID)
    assert d.action_kinds == ["stop"] and d.status["phase"] == "Suspended"
    back = decide(
        job({"phase": "Suspended"}),
        obs(raycluster=raycluster_in(None, suspend=True), cluster_patch_pending=True),
        SID,
    )
    assert back.actions == ()


def test_the_engine_plan_is_part_of_the_decision() -> None:
    """A request below minEngines is clamped: spec.rollout.engines is written first, then the rollout
    group follows the clamped count, and the status says so."""
    j = autoscaled(job(running()), minEngines=2, maxEngines=4)
    d = decide(j, obs(raycluster=with_rollout_group(raycluster_in(), 1), ray_job=ray("RUNNING")), SID)
    write = d.find(WriteEngines)
    assert write == WriteEngines(requested=1, engines=2, direction="up") and d.actions[0] == write
    scale = d.find(ScaleRolloutGroup)
    assert scale is not None and scale.replicas == j.spec.rollout.replicas(2)
    assert d.status["rollout"]["desiredEngines"] == 2
    assert any(reason == "EnginesClamped" for _, reason, _ in d.events)


def test_desired_engines_is_the_clamped_request_in_rounds_without_the_plan() -> None:
    """status.rollout.desiredEngines has one writer a round: where the engine plan does not run (a finished
    job, a job with no cluster, replicas Kueue holds) it is the request clamped into the autoscaling range."""
    stored = {"rollout": {"desiredEngines": 3}}
    finished = autoscaled(job({"phase": "Succeeded", **stored}), minEngines=2, maxEngines=4)
    assert decide(finished, obs(), SID).status["rollout"]["desiredEngines"] == 2
    pending = autoscaled(job({"phase": "Pending", **stored}), minEngines=2, maxEngines=4)
    assert decide(pending, obs(raycluster=None), SID).status["rollout"]["desiredEngines"] == 2
    held = autoscaled(queued(job(running(**stored))), minEngines=2, maxEngines=4)
    d = decide(held, obs(raycluster=kueue_cluster(suspend=False), ray_job=ray("RUNNING")), SID)
    assert d.status["rollout"]["desiredEngines"] == 2 and d.find(WriteEngines) is None


def test_the_group_already_at_size_gets_no_patch_and_a_patch_in_flight_none_again() -> None:
    j = job(running(startTime=iso(NOW)))
    at_size = with_rollout_group(raycluster_in(), j.spec.rollout.replicas())
    assert decide(j, obs(raycluster=at_size, ray_job=ray("RUNNING")), SID).actions == ()
    short = with_rollout_group(raycluster_in(), 0)
    d = decide(j, obs(raycluster=short, ray_job=ray("RUNNING")), SID)
    assert d.action_kinds == ["scale_rollout"]
    again = decide(j, obs(raycluster=short, ray_job=ray("RUNNING"), cluster_patch_pending=True), SID)
    assert again.actions == ()


def test_the_kueue_hold_is_an_input_not_a_veto() -> None:
    """A Kueue-managed cluster keeps its replicas: queued, no plan at all; admitted as a fixed-size
    workload, the EngineScaling condition says why, once."""
    j = queued(autoscaled(job(running(startTime=iso(NOW))), minEngines=2, maxEngines=4))
    held = with_rollout_group(kueue_cluster(False), 1)
    d = decide(j, obs(raycluster=held, ray_job=ray("RUNNING")), SID)
    assert d.actions == ()
    cond = next(c for c in d.status["conditions"] if c["type"] == "EngineScaling")
    assert cond["reason"] == "KueueNotElastic"
    assert [reason for _, reason, _ in d.events] == ["EngineScalingOff"]
    again = decide(
        queued(autoscaled(job(d.status), minEngines=2, maxEngines=4)),
        obs(raycluster=held, ray_job=ray("RUNNING")),
        SID,
    )
    assert again.events == () and again.actions == ()


def test_no_engine_plan_for_a_finishing_job_or_a_deleted_cluster() -> None:
    j = autoscaled(job(running()), minEngines=2, maxEngines=4)
    done = decide(j, obs(raycluster=with_rollout_group(raycluster_in(), 1), ray_job=ray("SUCCEEDED")), SID)
    assert done.action_kinds == ["delete_cluster"]
    timeout = autoscaled(
        job({"phase": "Provisioning", "activeSince": AGO}, provisioningTimeoutSeconds=60,
            onProvisioningTimeout="Restart"), minEngines=2, maxEngines=4,
    )  # fmt: skip
    restarted = decide(timeout, obs(raycluster=with_rollout_group(raycluster_in(None), 1)), SID)
    assert restarted.action_kinds == ["delete_cluster"]
