"""Jobs that cannot reach a running trainer say why, and end instead of sitting in Provisioning.

Against the real API server, scheduler and KubeRay: pods no node can take (the scheduler's
Unschedulable), a deadline that counts the time spent provisioning, a RayCluster an admission policy
denies (permanent: the job fails at once, no restart used) and one a ResourceQuota holds back
(transient: retried with backoff, and created once the quota is lifted).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import pytest
from testkit.support import Cluster, OperatorProcess, events, failing_job, job_status, phase_is, wait_for

pytestmark = pytest.mark.cluster

NOWHERE = {"spec.pods.nodeSelector": {"rlhf.dev/test-no-such-node": "true"}}
# The provisioning timeout: past the few seconds the pods take to be created and found Unschedulable
# (which the test reads in the status first), short for the suite's time.
TIMEOUT = 15


def test_unschedulable_pods_are_named_and_the_provisioning_timeout_fails_the_job(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    cluster.apply(
        failing_job("nowhere", **NOWHERE, **{"spec.runPolicy.provisioningTimeoutSeconds": TIMEOUT}), namespace
    )
    t0 = time.monotonic()
    st = wait_for(
        lambda: (
            (
                (s := job_status(cluster, namespace, "nowhere")).get("message", "").find("Unschedulable") >= 0
                and s
            )
            or None
        ),
        60,
        "status.message naming an Unschedulable pod",
    )
    print(f"unschedulable: said in status.message {time.monotonic() - t0:.1f} s after apply: {st['message']}")
    assert "pod nowhere-" in st["message"] and st["phase"] == "Provisioning", st
    cond = next(c for c in st["conditions"] if c["type"] == "PodsReady")
    assert (cond["status"], cond["reason"]) == ("False", "Unschedulable"), cond
    warned = [e for e in events(cluster, namespace, "nowhere") if e.get("reason") == "Unschedulable"]
    assert warned and warned[0]["type"] == "Warning", warned
    st = wait_for(lambda: phase_is(cluster, namespace, "nowhere", "Failed"), 90, "the provisioning timeout")
    failed_after = time.monotonic() - t0
    print(f"provisioningTimeoutSeconds={TIMEOUT}: Failed {failed_after:.1f} s after apply: {st['message']}")
    assert f"provisioningTimeoutSeconds={TIMEOUT}" in st["message"] and "Unschedulable" in st["message"], st
    assert st["restarts"] == 0
    assert TIMEOUT <= failed_after <= TIMEOUT + 35, failed_after


def test_the_deadline_counts_time_spent_provisioning(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    """The issue's measurement: a 5 s deadline on a job that cannot provision used to sit 90 s or more."""
    cluster.apply(failing_job("late", **NOWHERE, **{"spec.runPolicy.activeDeadlineSeconds": 5}), namespace)
    t0 = time.monotonic()
    st = wait_for(lambda: phase_is(cluster, namespace, "late", "Failed"), 60, "the deadline")
    print(f"activeDeadlineSeconds=5 while provisioning: Failed {time.monotonic() - t0:.1f} s after apply")
    failed = next(c for c in st["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "DeadlineExceeded", st
    assert cluster.get("raycluster", "late", namespace) is None or wait_for(
        lambda: cluster.get("raycluster", "late", namespace) is None or None, 30, "the RayCluster released"
    )


def deny_rayclusters(cluster: Cluster, namespace: str) -> str:
    name = f"test-deny-rayclusters-{uuid.uuid4().hex[:8]}"
    policy: dict[str, Any] = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": name},
        "spec": {
            "failurePolicy": "Fail",
            "matchConstraints": {
                "resourceRules": [
                    {
                        "apiGroups": ["ray.io"],
                        "apiVersions": ["*"],
                        "operations": ["CREATE"],
                        "resources": ["rayclusters"],
                    }
                ]
            },
            "validations": [
                {"expression": "false", "message": "RayClusters are not allowed here (test policy)"}
            ],
        },
    }
    binding = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": name},
        "spec": {
            "policyName": name,
            "validationActions": ["Deny"],
            "matchResources": {
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}}
            },
        },
    }
    cluster.apply(policy)
    cluster.apply(binding)
    probe = {
        "apiVersion": "ray.io/v1",
        "kind": "RayCluster",
        "metadata": {"name": "probe", "namespace": namespace},
        "spec": {"headGroupSpec": {"template": {"spec": {"containers": [{"name": "c", "image": "i"}]}}}},
    }
    wait_for(
        lambda: (
            "not allowed here"
            in cluster.kubectl(
                "create", "--dry-run=server", "-f", "-", input=json.dumps(probe), check=False
            ).stderr
            or None
        ),
        30,
        "the admission policy in force",
    )
    return name


def test_a_raycluster_the_api_server_refuses_fails_the_job_with_the_servers_words(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    policy = deny_rayclusters(cluster, namespace)
    try:
        cluster.apply(failing_job("denied"), namespace)
        st = wait_for(lambda: phase_is(cluster, namespace, "denied", "Failed"), 60, "the job Failed")
        print(f"refused: {st['message']}")
        assert "not allowed here (test policy)" in st["message"], st
        assert st["restarts"] == 0, st
        failed = next(c for c in st["conditions"] if c["type"] == "Failed")
        assert failed["reason"] == "RayClusterRejected", failed
        warned = [e for e in events(cluster, namespace, "denied") if e.get("reason") == "RayClusterRejected"]
        assert warned and warned[0]["type"] == "Warning" and "not allowed here" in warned[0]["message"]
        time.sleep(5)  # permanent: no further attempts
        assert (
            len([e for e in events(cluster, namespace, "denied") if e.get("reason") == "RayClusterRejected"])
            == 1
        )
    finally:
        cluster.kubectl(
            "delete", "validatingadmissionpolicybinding,validatingadmissionpolicy", policy, check=False
        )


def test_a_raycluster_held_back_by_quota_is_retried_until_the_quota_allows_it(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    quota = {
        "apiVersion": "v1",
        "kind": "ResourceQuota",
        "metadata": {"name": "no-rayclusters"},
        "spec": {"hard": {"count/rayclusters.ray.io": "0"}},
    }
    cluster.apply(quota, namespace)
    wait_for(
        lambda: (
            (cluster.get("resourcequota", "no-rayclusters", namespace) or {}).get("status", {}).get("hard")
            or None
        ),
        30,
        "the quota calculated",
    )
    cluster.apply(failing_job("held"), namespace)
    st = wait_for(
        lambda: (
            ((s := job_status(cluster, namespace, "held")).get("message", "").endswith("; retrying") and s)
            or None
        ),
        60,
        "status.message saying the quota holds the RayCluster back",
    )
    print(f"held back: {st['message']}")
    assert "quota" in st["message"] and st["phase"] in ("Pending", "Provisioning"), st
    time.sleep(6)  # retried with backoff, not failed
    assert job_status(cluster, namespace, "held")["phase"] in ("Pending", "Provisioning")
    cluster.kubectl("delete", "resourcequota", "no-rayclusters", "-n", namespace)
    t0 = time.monotonic()
    wait_for(lambda: cluster.get("raycluster", "held", namespace), 90, "the RayCluster created once allowed")
    print(f"quota lifted: RayCluster created {time.monotonic() - t0:.1f} s later")
