"""A job stuck before its trainer runs: why (from its pods), the deadline counted from its creation, the
provisioning timeout, and the API server refusing its RayCluster. Pure decisions (status.py)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from rlhf_operator.conditions import iso
from rlhf_operator.pod_problems import diagnose, rejection_is_permanent
from rlhf_operator.status import cluster_rejected, decide
from testkit.status_inputs import NOW, SID, job, obs, raycluster_in

pytestmark = pytest.mark.unit


def pod(name: str, *, unschedulable: str = "", waiting: str = "", message: str = "") -> dict[str, Any]:
    status: dict[str, Any] = {"phase": "Pending", "conditions": [], "containerStatuses": []}
    if unschedulable:
        status["conditions"].append(
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": unschedulable}
        )
    if waiting:
        state = {"waiting": {"reason": waiting, "message": message}}
        status["containerStatuses"].append({"name": "ray-worker", "state": state})
    return {"metadata": {"name": name}, "status": status}


UNSCHED = "0/3 nodes are available: 3 node(s) didn't match Pod's node affinity/selector."


def test_diagnose_names_the_pod_and_prefers_a_container_failure_to_scheduling() -> None:
    assert diagnose([pod("a"), pod("b")]) is None
    p = diagnose([pod("b-head", unschedulable=UNSCHED)])
    assert p is not None and (p.reason, p.pod) == ("Unschedulable", "b-head") and "node affinity" in p.message
    p = diagnose(
        [
            pod("a-head", unschedulable=UNSCHED),
            pod("z-worker", waiting="ImagePullBackOff", message="not found"),
        ]
    )
    assert p is not None and (p.reason, p.pod) == ("ImagePullBackOff", "z-worker")
    assert "container ray-worker: not found" in p.describe()
    # A normal start (ContainerCreating) is no problem.
    assert diagnose([pod("a", waiting="ContainerCreating")]) is None


def test_a_stuck_pod_is_said_in_message_condition_and_one_event() -> None:
    stuck = obs(raycluster=raycluster_in(None), pods=[pod("tiny-head-x", unschedulable=UNSCHED)])
    d = decide(job({"phase": "Provisioning"}), stuck, SID)
    assert d.status["phase"] == "Provisioning"
    assert "pod tiny-head-x: Unschedulable" in d.status["message"]
    cond = next(c for c in d.status["conditions"] if c["type"] == "PodsReady")
    assert (cond["status"], cond["reason"]) == ("False", "Unschedulable")
    assert [e for e in d.events if e[1] == "Unschedulable" and e[0] == "Warning"]
    again = decide(job(d.status), stuck, SID)  # the same problem next round: no second event
    assert not [e for e in again.events if e[1] == "Unschedulable"]
    fixed = decide(job(again.status), obs(raycluster=raycluster_in(None), pods=[pod("tiny-head-x")]), SID)
    cond = next(c for c in fixed.status["conditions"] if c["type"] == "PodsReady")
    assert cond["status"] == "True"


def test_the_deadline_counts_from_creation_so_provisioning_time_counts() -> None:
    created = job(activeDeadlineSeconds=5)
    created.metadata["creationTimestamp"] = iso(NOW - timedelta(seconds=90))
    d = decide(created, obs(raycluster=raycluster_in(None), pods=[pod("h", unschedulable=UNSCHED)]), SID)
    assert d.status["phase"] == "Failed"
    assert "activeDeadlineSeconds=5" in d.status["message"]
    failed = next(c for c in d.status["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "DeadlineExceeded"


def test_the_deadline_clock_restarts_on_unsuspension() -> None:
    suspended = decide(
        job(
            {"phase": "Running", "activeSince": iso(NOW - timedelta(hours=2))},
            suspend=True,
            activeDeadlineSeconds=3600,
        ),
        obs(),
        SID,
    )
    assert "activeSince" not in suspended.status
    resumed = decide(
        job(suspended.status, activeDeadlineSeconds=3600), obs(raycluster=raycluster_in(None)), SID
    )
    assert resumed.status["phase"] != "Failed" and resumed.status["activeSince"] == iso(NOW)


@pytest.mark.parametrize("action", ["Fail", "Restart"])
def test_provisioning_timeout(action: str) -> None:
    status = {"phase": "Provisioning", "activeSince": iso(NOW - timedelta(seconds=21)), "restarts": 0}
    policy = {"provisioningTimeoutSeconds": 20, "onProvisioningTimeout": action}
    stuck = obs(raycluster=raycluster_in(None), pods=[pod("h", unschedulable=UNSCHED)])
    within = decide(job({**status, "activeSince": iso(NOW - timedelta(seconds=19))}, **policy), stuck, SID)
    assert within.status["phase"] == "Provisioning"
    d = decide(job(status, **policy), stuck, SID)
    assert "provisioningTimeoutSeconds=20" in d.status["message"]
    if action == "Fail":
        assert d.status["phase"] == "Failed" and d.status["restarts"] == 0
    else:
        assert d.status["phase"] == "Restarting" and d.status["restarts"] == 1
        assert "delete_cluster" in d.action_kinds
        # The next attempt gets a full timeout of its own.
        nxt = decide(job(d.status, **policy), obs(raycluster=None), SID)
        assert nxt.status["phase"] == "Restarting" and nxt.action_kinds == ["create_cluster"]


def test_a_running_job_is_past_provisioning() -> None:
    status = {"phase": "Running", "activeSince": iso(NOW - timedelta(hours=1)), "startTime": iso(NOW)}
    d = decide(job(status, provisioningTimeoutSeconds=20), obs(), SID)
    assert d.status["phase"] != "Failed"


@pytest.mark.parametrize(
    ("code", "message", "permanent"),
    [
        (422, 'RayCluster.ray.io "x" is invalid: spec.headGroupSpec: denied by policy', True),
        (400, "admission webhook denied the request", True),
        (403, 'rayclusters.ray.io "x" is forbidden: denied by policy no-rayclusters', True),
        (
            403,
            'rayclusters.ray.io "x" is forbidden: exceeded quota: rc, requested: count/rayclusters.ray.io=1',
            False,
        ),
        (404, "the server could not find the requested resource", False),
        (429, "too many requests", False),
        (500, "etcdserver: request timed out", False),
    ],
)
def test_refusals_are_permanent_or_transient(code: int, message: str, permanent: bool) -> None:
    assert rejection_is_permanent(code, message) is permanent


def test_a_permanent_refusal_fails_the_job_without_using_a_restart() -> None:
    d = cluster_rejected(job({"phase": "Pending", "restarts": 0}), 422, "denied by policy", NOW)
    assert d.status["phase"] == "Failed" and d.status["restarts"] == 0
    assert "refused RayCluster tiny (422): denied by policy" in d.status["message"]
    assert [e for e in d.events if e[:2] == ("Warning", "RayClusterRejected")]


def test_a_transient_refusal_waits_and_says_so_once() -> None:
    quota = "exceeded quota: rc"
    d = cluster_rejected(job({"phase": "Pending"}), 403, quota, NOW)
    assert d.status["phase"] == "Pending" and d.status["message"].endswith("; retrying")
    assert [e for e in d.events if e[1] == "RayClusterCreateFailed"]
    again = cluster_rejected(job(d.status), 403, quota, NOW)
    assert not again.events


def test_a_refusal_before_any_status_still_says_restarts_zero() -> None:
    """The create handler can be refused before the job has a status at all (seen in CI)."""
    d = cluster_rejected(job(None), 422, "denied by policy", NOW)
    assert d.status["phase"] == "Failed" and d.status["restarts"] == 0
    assert cluster_rejected(job(None), 429, "slow down", NOW).status["restarts"] == 0
