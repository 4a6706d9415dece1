"""Pods of a job pass the restricted Pod Security Standard by default, as the API server enforces it.

The namespace is labelled `pod-security.kubernetes.io/enforce=restricted`, so the API server's
PodSecurity admission rejects any pod KubeRay creates from our templates that breaks the profile,
including what KubeRay adds to them. The trainer entrypoint fails fast here (its reward function does
not import, as in test_operator_lifecycle): what is under test is that every pod is admitted and runs.
"""

from __future__ import annotations

from typing import Any

import pytest
from testkit.support import Cluster, OperatorProcess, failing_job, wait_for

pytestmark = pytest.mark.cluster

RESTRICTED = {
    "pod-security.kubernetes.io/enforce": "restricted",
    "pod-security.kubernetes.io/enforce-version": "latest",
}


def restrict(cluster: Cluster, namespace: str) -> None:
    labels = [f"{k}={v}" for k, v in RESTRICTED.items()]
    cluster.kubectl("label", "namespace", namespace, "--overwrite", *labels)


def pods(cluster: Cluster, namespace: str, name: str) -> list[dict[str, Any]]:
    return cluster.list("pods", namespace, selector=f"ray.io/cluster={name}")


def rejections(cluster: Cluster, namespace: str) -> list[str]:
    return [
        str(e.get("message", ""))
        for e in cluster.list("events", namespace)
        if "violates PodSecurity" in str(e.get("message", ""))
    ]


def test_the_job_runs_in_a_namespace_that_enforces_the_restricted_profile(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    restrict(cluster, namespace)
    cluster.apply(failing_job("tiny", **{"spec.runPolicy.backoffLimit": 20}), namespace)
    rc = wait_for(lambda: cluster.get("raycluster", "tiny", namespace), 30, "the RayCluster")
    want = 1 + sum(int(g["replicas"]) for g in rc["spec"]["workerGroupSpecs"])
    running = wait_for(
        lambda: (
            (
                (p := pods(cluster, namespace, "tiny"))
                and len(p) == want
                and all(x["status"].get("phase") == "Running" for x in p)
                and p
            )
            or None
        ),
        90,
        f"{want} pods admitted under the restricted profile and Running (rejections: see events)",
    )
    assert {p["metadata"]["labels"]["rlhf.dev/role"] for p in running} == {"head", "trainer", "rollout"}
    assert not rejections(cluster, namespace), rejections(cluster, namespace)


def test_a_capability_beyond_the_profile_is_refused_by_admission(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    """The other side: the profile is enforced here, so the test above could fail. A trainer asking for
    IPC_LOCK (InfiniBand) is refused, naming the capability; the head, which does not, is admitted."""
    restrict(cluster, namespace)
    trainer = {"containerSecurityContext": {"capabilities": {"drop": ["ALL"], "add": ["IPC_LOCK"]}}}
    cluster.apply(
        failing_job("ib", **{"spec.runPolicy.backoffLimit": 20, "spec.pods.trainer": trainer}), namespace
    )
    refused = wait_for(lambda: rejections(cluster, namespace) or None, 60, "a PodSecurity rejection")
    assert any("IPC_LOCK" in m for m in refused), refused
    # The head, which asks for no capability, is admitted. (KubeRay creates worker groups in order and
    # stops at the first refusal, so the rollout pods, listed after the trainer's, wait behind it.)
    wait_for(
        lambda: (
            {p["metadata"]["labels"]["rlhf.dev/role"] for p in pods(cluster, namespace, "ib")} == {"head"}
            or None
        ),
        60,
        "the head pod admitted",
    )
    assert not [
        p for p in pods(cluster, namespace, "ib") if p["metadata"]["labels"]["rlhf.dev/role"] == "trainer"
    ]
