"""The pure security pieces: per-job tokens, the pods' auth env, the NetworkPolicy, the operator's key."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest
import yaml
from rlhf_api.spec import RLHFJob
from rlhf_operator import manifests, rayjobs, security

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
KEY = b"x" * 32


def _job_with(uid: str = "1234abcd-0000", **spec: Any) -> RLHFJob:
    doc = yaml.safe_load((ROOT / "examples" / "rlhfjob-tiny.yaml").read_text())
    doc["metadata"] = {"name": "j", "namespace": "ns", "uid": uid}
    doc["spec"].update(spec)
    return RLHFJob.model_validate(doc)


def test_a_token_belongs_to_one_job_and_one_key() -> None:
    a = security.token_of(KEY, _job_with())
    assert a == security.token_of(KEY, _job_with()) and len(a) == 64
    assert a != security.token_of(KEY, _job_with(uid="ffff0000-1111"))  # the same name created again
    assert a != security.token_of(b"y" * 32, _job_with())
    assert a != security.job_token(KEY, "other", "j", "1234abcd-0000")
    with pytest.raises(ValueError, match="no uid"):
        security.token_of(KEY, _job_with(uid=""))
    with pytest.raises(ValueError, match="empty key"):
        security.job_token(b"", "ns", "j", "u")


def test_every_ray_container_gets_token_mode_from_the_jobs_secret() -> None:
    rc = manifests.build_raycluster(_job_with())
    templates = [rc["spec"]["headGroupSpec"]["template"]] + [
        g["template"] for g in rc["spec"]["workerGroupSpecs"]
    ]
    assert len(templates) == 3
    for t in templates:
        env = {e["name"]: e for e in t["spec"]["containers"][0]["env"]}
        assert env["RAY_AUTH_MODE"]["value"] == "token"
        assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == {
            "name": "j-ray-token-1234abcd",
            "key": "token",
        }
    off = manifests.build_raycluster(_job_with(security={"rayAuthentication": "Disabled"}))
    env = {e["name"]: e for e in off["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["RAY_AUTH_MODE"]["value"] == "disabled" and "RAY_AUTH_TOKEN" not in env


def test_security_objects_follow_the_spec() -> None:
    access = security.PolicyAccess("ops", {"app": "op"})
    kinds = [o["kind"] for o in manifests.security_objects(_job_with(), KEY, access)]
    assert kinds == ["Secret", "NetworkPolicy"]
    secret = manifests.security_objects(_job_with(), KEY, access)[0]
    assert secret["stringData"] == {"token": security.token_of(KEY, _job_with())}
    assert secret["metadata"]["namespace"] == "ns" and secret["immutable"] is True
    assert (
        manifests.security_objects(_job_with(security={"networkPolicy": "Disabled"}), KEY, access)[0]["kind"]
        == "Secret"
    )
    none = _job_with(security={"networkPolicy": "Disabled", "rayAuthentication": "Disabled"})
    assert manifests.security_objects(none, KEY, access) == []
    assert len(security.disabled_warnings(none)) == 2 and security.disabled_warnings(_job_with()) == []


def _kinds(objects: list[dict[str, Any]]) -> list[str]:
    return [o["kind"] for o in objects]


def test_with_a_token_the_raycluster_goes_first_and_the_policy_before_the_secret() -> None:
    access = security.PolicyAccess("ops", {"app": "op"})
    before, after = security.creation_order(manifests.security_objects(_job_with(), KEY, access))
    assert (_kinds(before), _kinds(after)) == ([], ["NetworkPolicy", "Secret"])
    no_policy = manifests.security_objects(_job_with(security={"networkPolicy": "Disabled"}), KEY, access)
    assert security.creation_order(no_policy) == ([], no_policy)


def test_without_a_token_nothing_holds_the_pods_back_so_the_policy_goes_first() -> None:
    access = security.PolicyAccess("ops", {"app": "op"})
    open_job = _job_with(security={"rayAuthentication": "Disabled"})
    before, after = security.creation_order(manifests.security_objects(open_job, KEY, access))
    assert (_kinds(before), _kinds(after)) == (["NetworkPolicy"], [])
    assert security.creation_order([]) == ([], [])


@pytest.mark.parametrize("example", ["rlhfjob-tiny.yaml", "rlhfjob-tiny-s3-tracked.yaml"])
def test_no_container_of_the_jobs_pods_can_start_without_its_secret(example: str) -> None:
    """What lets the RayCluster go before the Secret (security.creation_order): every container of every pod
    (init containers too) reads the token by a secretKeyRef that is not optional, so the kubelet starts none
    of them before the Secret exists."""
    doc = yaml.safe_load((ROOT / "examples" / example).read_text())
    doc["metadata"].update(namespace="ns", uid="1234abcd-0000")
    rc = manifests.build_raycluster(RLHFJob.model_validate(doc))
    templates = [rc["spec"]["headGroupSpec"]["template"]] + [
        g["template"] for g in rc["spec"]["workerGroupSpecs"]
    ]
    containers = [c for t in templates for c in t["spec"].get("initContainers", []) + t["spec"]["containers"]]
    assert len(containers) >= len(templates)
    for c in containers:
        ref = next(e for e in c["env"] if e["name"] == "RAY_AUTH_TOKEN")["valueFrom"]["secretKeyRef"]
        assert ref["name"].endswith("-ray-token-1234abcd") and not ref.get("optional"), (c["name"], ref)


def test_the_policy_admits_the_job_the_operator_and_the_scrapers_only() -> None:
    j = _job_with()
    port = j.spec.monitoring.metrics_port
    default = security.network_policy(
        j, {"name": "j"}, {"rlhf.dev/job": "j"}, security.PolicyAccess("ops", {"app": "op"})
    )
    ingress = default["spec"]["ingress"]
    assert ingress[0] == {"from": [{"podSelector": {"matchLabels": {"rlhf.dev/job": "j"}}}]}
    assert ingress[1]["from"][0]["namespaceSelector"] == {
        "matchLabels": {"kubernetes.io/metadata.name": "ops"}
    }
    assert [p["port"] for p in ingress[1]["ports"]] == [8265, port]
    # No scrapers configured: the job's own namespace, on the metrics port only.
    assert ingress[2] == {"from": [{"podSelector": {}}], "ports": [{"protocol": "TCP", "port": port}]}
    assert default["spec"]["policyTypes"] == ["Ingress"]


def test_the_operators_identity_comes_from_its_environment() -> None:
    env = {
        "POD_NAMESPACE": "ops",
        "RLHF_OPERATOR_POD_LABELS": json.dumps({"app": "op"}),
        "RLHF_METRICS_FROM": json.dumps([{"podSelector": {"matchLabels": {"app": "prom"}}}]),
    }
    access = security.policy_access_from_env(env)
    assert access.operator_namespace == "ops" and dict(access.operator_pod_labels) == {"app": "op"}
    assert access.metrics_from == ({"podSelector": {"matchLabels": {"app": "prom"}}},)
    dev = security.policy_access_from_env({})
    assert dev.operator_pod_labels == {"app.kubernetes.io/name": "rlhf-operator"} and dev.metrics_from == ()
    with pytest.raises(ValueError, match="RLHF_METRICS_FROM"):
        security.policy_access_from_env({"RLHF_METRICS_FROM": '{"podSelector": {}}'})
    with pytest.raises(ValueError, match="RLHF_OPERATOR_POD_LABELS"):
        security.policy_access_from_env({"RLHF_OPERATOR_POD_LABELS": '{"a": 1}'})


def test_the_token_key_is_configured_or_made_once_per_user(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv(rayjobs.TOKEN_KEY_ENV, raising=False)
    rayjobs.token_key.cache_clear()
    made = rayjobs.token_key()
    path = tmp_path / "cache" / "rlhf-operator" / "ray-token-key"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and len(made) == 64 and made.strip() == made
    rayjobs.token_key.cache_clear()
    assert rayjobs.token_key() == made  # a restart keeps every job's token

    short = tmp_path / "short"
    short.write_bytes(b"abc")
    monkeypatch.setenv(rayjobs.TOKEN_KEY_ENV, str(short))
    rayjobs.token_key.cache_clear()
    with pytest.raises(rayjobs.RayJobsError, match="at least 32"):
        rayjobs.token_key()
    monkeypatch.setenv(rayjobs.TOKEN_KEY_ENV, str(tmp_path / "missing"))
    rayjobs.token_key.cache_clear()
    with pytest.raises(rayjobs.RayJobsError, match="RLHF_RAY_TOKEN_KEY_FILE"):
        rayjobs.token_key()
    rayjobs.token_key.cache_clear()
