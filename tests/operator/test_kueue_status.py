"""A job whose RayCluster Kueue manages: queued with Kueue's reason, admitted, evicted (preempted) and
readmitted, without the operator ever writing the cluster's spec.suspend; the deadline counts admitted
time only; replicas are held unless Kueue took the cluster as elastic. Pure decisions (status.py,
kueue.py, manifests.py)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from rlhf_api.spec import RLHFJob
from rlhf_operator import kueue, manifests
from rlhf_operator.actions import StopRayJob, SubmitTrainer
from rlhf_operator.conditions import iso
from rlhf_operator.status import decide
from testkit.status_inputs import NOW, SID, job, obs, ray

pytestmark = pytest.mark.unit

QUEUE = "research"
PENDING_MSG = "couldn't assign flavors to pod set head: insufficient unused quota for nvidia.com/gpu"


def queued_job(status: dict[str, Any] | None = None, **run_policy: Any) -> RLHFJob:
    j = job(status, **run_policy)
    j.metadata.setdefault("labels", {})[kueue.QUEUE_LABEL] = QUEUE
    return j


def kcluster(
    suspend: bool, state: str | None = "ready", gated: bool = False, **status: Any
) -> dict[str, Any]:
    st: dict[str, Any] = dict(status)
    if state:
        st["state"] = state
    spec: dict[str, Any] = {"suspend": suspend}
    if gated:
        spec["headGroupSpec"] = {"template": {"spec": {"schedulingGates": [{"name": kueue.ELASTIC_GATE}]}}}
    meta = {"name": "tiny", "namespace": "ns", "uid": "rc-uid", "labels": {kueue.QUEUE_LABEL: QUEUE}}
    return {"metadata": meta, "spec": spec, "status": st}


def workload(*conditions: tuple[str, str, str, str]) -> dict[str, Any]:
    return kueue.slim_workload(
        {
            "metadata": {"name": "raycluster-tiny-abc"},
            "status": {
                "conditions": [
                    {"type": t, "status": s, "reason": r, "message": m, "lastTransitionTime": "x"}
                    for t, s, r, m in conditions
                ]
            },
        }
    )


PENDING = workload(("QuotaReserved", "False", "Pending", PENDING_MSG))
PREEMPTED = workload(
    ("QuotaReserved", "False", "Pending", PENDING_MSG),
    ("Evicted", "True", "Preempted", "Preempted to accommodate a workload (UID: x) due to prioritization"),
)


def test_a_job_kueue_holds_is_queued_with_kueues_reason_and_no_write_to_suspend() -> None:
    d = decide(queued_job({"phase": "Pending"}), obs(raycluster=kcluster(True), workload=PENDING), SID)
    assert d.status["phase"] == "Queued"
    assert d.action_kinds == []  # no suspend_cluster: spec.suspend is Kueue's
    cond = next(c for c in d.status["conditions"] if c["type"] == "Queued")
    assert (cond["status"], cond["reason"], cond["message"]) == ("True", "Pending", PENDING_MSG)
    assert QUEUE in d.status["message"] and "insufficient unused quota" in d.status["message"]
    assert ("Normal", "Queued") in [(t, r) for t, r, _ in d.events]
    assert "activeSince" not in d.status


def test_a_new_job_first_written_provisioning_is_queued_not_evicted() -> None:
    # The create handler's first phase is Provisioning, before any round has seen Kueue's suspension.
    d = decide(queued_job({"phase": "Provisioning"}), obs(raycluster=kcluster(True), workload=PENDING), SID)
    assert d.status["phase"] == "Queued" and "preemptions" not in d.status and d.action_kinds == []
    assert [(t, r) for t, r, _ in d.events] == [("Normal", "Queued")]


def test_without_a_workload_yet_the_reason_says_so() -> None:
    d = decide(queued_job({"phase": "Pending"}), obs(raycluster=kcluster(True)), SID)
    cond = next(c for c in d.status["conditions"] if c["type"] == "Queued")
    assert cond["reason"] == "WorkloadPending" and QUEUE in cond["message"]


def test_admission_starts_the_deadline_clock_and_provisions() -> None:
    queued = queued_job({"phase": "Queued"}, activeDeadlineSeconds=60)
    queued.metadata["creationTimestamp"] = iso(NOW - timedelta(hours=3))  # queued far longer than 60 s
    d = decide(queued, obs(raycluster=kcluster(False, state=None)), SID)
    assert d.status["phase"] == "Provisioning", d.status
    assert d.status["activeSince"] == iso(NOW)
    assert "suspend_cluster" not in d.action_kinds
    assert ("Normal", "Admitted") in [(t, r) for t, r, _ in d.events]
    # The admitted job then runs past its creation + deadline, within activeSince + deadline.
    later = decide(
        queued_job(d.status, activeDeadlineSeconds=60),
        obs(raycluster=kcluster(False), ray_job=ray("RUNNING"), now=NOW + timedelta(seconds=30)),
        SID,
    )
    assert later.status["phase"] == "Running"


def test_readmission_restarts_the_deadline_clock_though_the_job_started_before() -> None:
    # Evicted after it ran: its startTime is its first admission's, 3 h ago. Counted from there, the
    # 60 s deadline would fail the job at once; from its readmission, it has all 60 s again.
    started = iso(NOW - timedelta(hours=3))
    readmitted = queued_job(
        {"phase": "Queued", "startTime": started, "preemptions": 1}, activeDeadlineSeconds=60
    )
    readmitted.metadata["creationTimestamp"] = started
    d = decide(readmitted, obs(raycluster=kcluster(False, state=None)), SID)
    assert d.status["phase"] == "Provisioning", d.status
    assert d.status["activeSince"] == iso(NOW)
    later = decide(
        queued_job(d.status, activeDeadlineSeconds=60),
        obs(raycluster=kcluster(False), ray_job=ray("RUNNING"), now=NOW + timedelta(seconds=30)),
        SID,
    )
    assert later.status["phase"] == "Running", later.status


def test_a_queued_job_never_fails_its_deadline() -> None:
    queued = queued_job({"phase": "Queued"}, activeDeadlineSeconds=5)
    queued.metadata["creationTimestamp"] = iso(NOW - timedelta(hours=3))
    d = decide(queued, obs(raycluster=kcluster(True), workload=PENDING), SID)
    assert d.status["phase"] == "Queued"


def test_eviction_of_a_running_job_stops_its_trainer_and_counts_a_preemption_not_a_restart() -> None:
    running = {"phase": "Running", "submissionId": SID, "headPod": "tiny-head-a", "restarts": 1, "step": 3}
    d = decide(
        queued_job(running), obs(raycluster=kcluster(True, state="suspended"), workload=PREEMPTED), SID
    )
    assert d.status["phase"] == "Queued"
    assert d.status["preemptions"] == 1 and d.status["restarts"] == 1
    assert d.actions == (StopRayJob(SID),)
    assert "submissionId" not in d.status and "headPod" not in d.status
    cond = next(c for c in d.status["conditions"] if c["type"] == "Queued")
    assert cond["reason"] == "Preempted"
    warned = [(t, r) for t, r, _ in d.events]
    assert ("Warning", "Preempted") in warned
    # The next round: still queued, no second stop, no second count.
    again = decide(queued_job(d.status), obs(raycluster=kcluster(True), workload=PREEMPTED), SID)
    assert again.status["preemptions"] == 1 and again.action_kinds == [] and again.events == ()


def test_a_readmitted_job_submits_a_new_attempt_id() -> None:
    uid = "0123abcd-ffff"
    j = queued_job()
    first, second = manifests.submission_id(j, uid, 1), manifests.submission_id(j, uid, 1, preemptions=1)
    assert first != second and first == f"rlhf-ns-tiny-{uid[:8]}-1"
    readmitted = decide(
        queued_job({"phase": "Provisioning", "preemptions": 1, "restarts": 1}),
        obs(raycluster=kcluster(False)),
        second,
    )
    assert readmitted.actions == (SubmitTrainer(second),)


def test_run_policy_suspend_of_a_kueue_job_deletes_its_cluster_instead_of_writing_suspend() -> None:
    d = decide(queued_job({"phase": "Running"}, suspend=True), obs(raycluster=kcluster(False)), SID)
    assert "delete_cluster" in d.action_kinds and "suspend_cluster" not in d.action_kinds
    assert d.status["phase"] == "Suspended"
    resumed = decide(queued_job(d.status), obs(raycluster=None), SID)
    assert resumed.action_kinds == ["create_cluster"] and resumed.status["phase"] == "Pending"
    assert resumed.status["activeSince"] == iso(NOW)


def test_without_a_queue_label_the_operator_still_unsuspends_its_own_cluster() -> None:
    plain = kcluster(True)
    plain["metadata"]["labels"] = {}
    d = decide(job({"phase": "Running"}), obs(raycluster=plain), SID)
    assert "suspend_cluster" in d.action_kinds


def test_replicas_are_held_while_queued_and_while_admitted_unless_elastic() -> None:
    assert kueue.holds_replicas(kcluster(True))
    assert kueue.holds_replicas(kcluster(True, gated=True))
    assert kueue.holds_replicas(kcluster(False))
    assert not kueue.holds_replicas(kcluster(False, gated=True))
    conds, said = kueue.fixed_size_condition([], 2, NOW)
    assert said is not None and "stay at 2" in said
    assert conds[0]["type"] == "EngineScaling" and conds[0]["reason"] == "KueueNotElastic"
    assert kueue.fixed_size_condition(conds, 2, NOW)[1] is None  # said once


def test_why_waiting_prefers_the_eviction_then_the_quota() -> None:
    assert kueue.why_waiting(PREEMPTED, QUEUE)[0] == "Preempted"
    assert kueue.why_waiting(PENDING, QUEUE) == ("Pending", PENDING_MSG)
    admitted = workload(("QuotaReserved", "True", "QuotaReserved", ""), ("Admitted", "True", "Admitted", ""))
    assert kueue.why_waiting(admitted, QUEUE)[0] == "Admitted"


def test_the_raycluster_of_a_queued_job_asks_for_an_elastic_workload_and_stops_gracefully() -> None:
    j = queued_job(terminationGracePeriodSeconds=120)
    rc = manifests.build_raycluster(j)
    assert rc["metadata"]["labels"][kueue.QUEUE_LABEL] == QUEUE
    assert rc["metadata"]["annotations"] == {kueue.ELASTIC_ANNOTATION: "true"}
    head = rc["spec"]["headGroupSpec"]["template"]["spec"]
    assert head["terminationGracePeriodSeconds"] == 120
    hook = head["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
    assert hook == ["python", "-m", "rlhf_trainer.preempt"]
    env = manifests.trainer_runtime_env(j)["env_vars"]
    assert env["RLHF_STOP_BUDGET_SECONDS"] == env["RAY_JOB_STOP_WAIT_TIME_S"] == "110"
    assert "annotations" not in manifests.build_raycluster(job())["metadata"]
