"""The operator makes each job's token Secret and NetworkPolicy, owned by the job, and they go with it.

The operator runs as a local process against the control plane; its development head override points
at a port where nothing listens, so no trainer runs: what is under test is the objects the operator
creates and the API server's garbage collector removing them. Whether a CNI enforces the policy is
not tested here (docs/security.md says why).
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest
from testkit.support import (
    Cluster,
    OperatorProcess,
    audited_creates,
    drop_rlhfjobs,
    events,
    example_job,
    free_port,
    wait_for,
)

pytestmark = pytest.mark.security

OPERATOR_NS = "rlhf-system"
OPERATOR_LABELS = {"app.kubernetes.io/name": "rlhf-operator", "app.kubernetes.io/instance": "sec"}
SCRAPERS = [
    {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
    }
]


@pytest.fixture
def secured_operator(cluster: Cluster, namespace: str, rlhf_crd: str, tmp_path: Path) -> Any:
    """The operator with the test's key, watching the test's namespace only, stopped (and its jobs
    deleted) when the test ends.

    Another operator acting in that namespace (one an earlier test left running) would make the job's
    Secret from its own key: the token check below fails then, naming the two tokens.
    """
    key = tmp_path / "ray-token-key"
    key.write_bytes(b"s" * 40)
    op = OperatorProcess(
        cluster,
        tmp_path / "operator.log",
        {
            "RLHF_DEV_DASHBOARD_PORT": str(free_port()),  # nothing listens: no trainer runs
            "RLHF_RAY_TOKEN_KEY_FILE": str(key),
            "POD_NAMESPACE": OPERATOR_NS,
            "RLHF_OPERATOR_POD_LABELS": json.dumps(OPERATOR_LABELS),
            "RLHF_METRICS_FROM": json.dumps(SCRAPERS),
        },
        namespaces=[namespace],
    )
    op.start()
    yield key.read_bytes()
    op.stop()
    drop_rlhfjobs(cluster, namespace)  # before the namespace fixture deletes the namespace
    print(f"--- operator log tail ---\n{op.log_tail()}")


def owned_by(obj: dict[str, Any], job: dict[str, Any]) -> bool:
    return any(r.get("uid") == job["metadata"]["uid"] for r in obj["metadata"].get("ownerReferences", []))


def container_env(rc: dict[str, Any]) -> list[list[dict[str, Any]]]:
    templates = [rc["spec"]["headGroupSpec"]["template"]]
    templates += [g["template"] for g in rc["spec"]["workerGroupSpecs"]]
    return [c["env"] for t in templates for c in t["spec"]["containers"]]


def test_the_job_owns_its_token_secret_and_network_policy(
    cluster: Cluster, namespace: str, secured_operator: bytes
) -> None:
    from rlhf_operator.security import job_token

    cluster.apply(example_job("sec"), namespace)
    job = wait_for(lambda: cluster.get("rlhfjob", "sec", namespace), 30, "the RLHFJob")
    uid = job["metadata"]["uid"]
    secret_name = f"sec-ray-token-{uid[:8]}"
    secret = wait_for(lambda: cluster.get("secret", secret_name, namespace), 60, f"Secret {secret_name}")
    policy = wait_for(lambda: cluster.get("networkpolicy", "sec", namespace), 60, "the NetworkPolicy")
    rc = wait_for(lambda: cluster.get("raycluster", "sec", namespace), 60, "the RayCluster")

    # The order (docs/security.md, "The order of a job's objects"), from the API server's own record: the
    # RayCluster's create answered before the NetworkPolicy's began, and the policy's before the Secret's.
    (rc_create,) = audited_creates("rayclusters", namespace, "sec")
    (policy_create,) = audited_creates("networkpolicies", namespace, "sec")
    (secret_create,) = audited_creates("secrets", namespace, secret_name)
    assert rc_create["stageTimestamp"] <= policy_create["requestReceivedTimestamp"], (
        rc_create,
        policy_create,
    )
    assert policy_create["stageTimestamp"] <= secret_create["requestReceivedTimestamp"], (
        policy_create,
        secret_create,
    )

    # The Secret holds the token the operator derives (and sends on its Jobs API calls), and is the job's.
    token = base64.b64decode(secret["data"]["token"]).decode()
    assert token == job_token(secured_operator, namespace, "sec", uid)
    assert owned_by(secret, job) and secret.get("immutable") is True
    # Every Ray container starts in token mode with the token from that Secret.
    for env in container_env(rc):
        by_name = {e["name"]: e for e in env}
        assert by_name["RAY_AUTH_MODE"]["value"] == "token"
        assert by_name["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": secret_name, "key": "token"}

    # The policy: the job's pods admit each other, the operator on the Jobs API and metrics ports, and
    # the configured scrapers on the metrics port; nothing else.
    metrics_port = job["spec"]["monitoring"]["metricsPort"]
    selector = {"rlhf.dev/job": "sec", "app.kubernetes.io/managed-by": "rlhf-operator"}
    assert owned_by(policy, job)
    spec = policy["spec"]
    assert spec["podSelector"] == {"matchLabels": selector} and spec["policyTypes"] == ["Ingress"]
    ingress = spec["ingress"]
    assert ingress[0] == {"from": [{"podSelector": {"matchLabels": selector}}]}
    assert ingress[1]["from"] == [
        {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": OPERATOR_NS}},
            "podSelector": {"matchLabels": OPERATOR_LABELS},
        }
    ]
    assert {p["port"] for p in ingress[1]["ports"]} == {8265, metrics_port}
    assert ingress[2] == {"from": SCRAPERS, "ports": [{"protocol": "TCP", "port": metrics_port}]}
    assert len(ingress) == 3
    # The policy selects the pods KubeRay made for the job: every one of them carries its labels.
    pods = wait_for(
        lambda: cluster.list("pods", namespace, selector="ray.io/cluster=sec") or None, 60, "the job's pods"
    )
    assert all(selector.items() <= p["metadata"]["labels"].items() for p in pods)
    assert not [e for e in events(cluster, namespace, "sec") if e["reason"] == "SecurityDisabled"]

    cluster.kubectl("delete", "rlhfjob", "sec", "-n", namespace, "--wait=true", timeout=120)
    wait_for(
        lambda: (
            (
                cluster.get("secret", secret_name, namespace) is None
                and cluster.get("networkpolicy", "sec", namespace) is None
            )
            or None
        ),
        90,
        "the garbage collector to delete the job's Secret and NetworkPolicy",
    )


def test_turning_protection_off_is_explicit_and_warned(
    cluster: Cluster, namespace: str, secured_operator: bytes
) -> None:
    off = {"rayAuthentication": "Disabled", "networkPolicy": "Disabled"}
    cluster.apply(example_job("open", **{"spec.security": off}), namespace)
    rc = wait_for(lambda: cluster.get("raycluster", "open", namespace), 60, "the RayCluster")
    warnings = wait_for(
        lambda: (
            [e for e in events(cluster, namespace, "open") if e["reason"] == "SecurityDisabled"]
            if len([e for e in events(cluster, namespace, "open") if e["reason"] == "SecurityDisabled"]) == 2
            else None
        ),
        30,
        "two SecurityDisabled Warning Events",
    )
    assert {w["type"] for w in warnings} == {"Warning"}
    text = " ".join(w["message"] for w in warnings)
    assert "spec.security.rayAuthentication" in text and "spec.security.networkPolicy" in text
    for env in container_env(rc):
        by_name = {e["name"]: e for e in env}
        assert by_name["RAY_AUTH_MODE"] == {"name": "RAY_AUTH_MODE", "value": "disabled"}
        assert "RAY_AUTH_TOKEN" not in by_name
    assert cluster.get("networkpolicy", "open", namespace) is None
    assert not cluster.list("secrets", namespace, selector="rlhf.dev/job=open")
