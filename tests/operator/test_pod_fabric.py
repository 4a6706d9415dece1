"""`spec.pods.fabric`: settings of every pod that talks NCCL (trainer and rollout), given once, never on the
head; merged job-wide defaults -> fabric -> role (rlhf_api.pod_settings.for_role, as the RayCluster renders)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from rlhf_api.spec import RLHFJob
from rlhf_api.validate import validate_manifest
from rlhf_operator import manifests

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
RDMA = "rdma/rdma_shared_device_a"
NETWORK = "k8s.v1.cni.cncf.io/networks"
IB_CAPABILITIES = {"drop": ["ALL"], "add": ["IPC_LOCK"]}


def manifest(name: str, pods: dict[str, Any] | None = None) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((ROOT / "examples" / name).read_text())
    doc["metadata"]["namespace"] = "team-a"
    if pods is not None:
        doc["spec"]["pods"] = pods
    return doc


def pods_of(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """role -> rendered pod template."""
    rc = manifests.build_raycluster(RLHFJob.model_validate(doc))
    out = {"head": rc["spec"]["headGroupSpec"]["template"]}
    out.update({g["groupName"]: g["template"] for g in rc["spec"]["workerGroupSpecs"]})
    return out


def env(pod: dict[str, Any]) -> dict[str, str | None]:
    return {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}


def test_fabric_reaches_trainer_and_rollout_pods_never_the_head_and_a_role_still_wins() -> None:
    fabric = {
        "resources": {"limits": {RDMA: 1}},
        "env": [{"name": "NCCL_IB_HCA", "value": "mlx5"}, {"name": "NCCL_DEBUG", "value": "INFO"}],
        "annotations": {NETWORK: "ib-sriov"},
        "labels": {"fabric": "ib"},
        "containerSecurityContext": {"capabilities": IB_CAPABILITIES},
        "volumes": [{"name": "ib-cache", "emptyDir": {}}],
        "volumeMounts": [{"name": "ib-cache", "mountPath": "/ib"}],
    }
    pods = pods_of(
        manifest(
            "rlhfjob-tiny.yaml",
            {
                "env": [{"name": "NCCL_DEBUG", "value": "WARN"}],
                "resources": {"requests": {"cpu": 2}},
                "fabric": fabric,
                "rollout": {
                    "env": [{"name": "NCCL_DEBUG", "value": "TRACE"}],
                    "annotations": {NETWORK: "ib-b"},
                },
            },
        )
    )
    assert set(pods) == {"head", "trainer", "rollout"}
    head = pods["head"]
    [hc] = head["spec"]["containers"]
    assert "NCCL_IB_HCA" not in env(head) and env(head)["NCCL_DEBUG"] == "WARN"  # the job-wide default only
    assert hc["resources"] == {"requests": {"cpu": 2}}
    assert (
        NETWORK not in head["metadata"].get("annotations", {}) and "fabric" not in head["metadata"]["labels"]
    )
    assert hc["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert "ib-cache" not in {v["name"] for v in head["spec"]["volumes"]}
    for role in ("trainer", "rollout"):
        pod = pods[role]
        [c] = pod["spec"]["containers"]
        assert env(pod)["NCCL_IB_HCA"] == "mlx5", role
        assert c["resources"]["limits"][RDMA] == 1 and c["resources"]["requests"]["cpu"] == 2, role
        assert c["resources"]["limits"]["nvidia.com/gpu"], role  # beside the placements' GPUs
        assert c["securityContext"]["capabilities"] == IB_CAPABILITIES, role
        assert pod["metadata"]["labels"]["fabric"] == "ib", role
        assert "ib-cache" in {v["name"] for v in pod["spec"]["volumes"]}, role
        assert {"name": "ib-cache", "mountPath": "/ib"} in c["volumeMounts"], role
    # fabric over the job-wide default; the role's own over fabric
    assert env(pods["trainer"])["NCCL_DEBUG"] == "INFO"
    assert pods["trainer"]["metadata"]["annotations"][NETWORK] == "ib-sriov"
    assert env(pods["rollout"])["NCCL_DEBUG"] == "TRACE"
    assert pods["rollout"]["metadata"]["annotations"][NETWORK] == "ib-b"


def test_the_8b_examples_infiniband_settings_reach_both_nccl_roles() -> None:
    pods = pods_of(manifest("rlhfjob-llama-8b.yaml"))
    for role, pod in pods.items():
        [c] = pod["spec"]["containers"]
        ib = (
            env(pod).get("NCCL_IB_HCA") == "mlx5",
            RDMA in c["resources"].get("limits", {}),
            c["securityContext"]["capabilities"] == IB_CAPABILITIES,
            NETWORK in pod["metadata"].get("annotations", {}),
        )
        assert ib == ((False,) * 4 if role == "head" else (True,) * 4), (role, ib)


def test_fabric_is_checked_like_every_role() -> None:
    doc = manifest(
        "rlhfjob-tiny.yaml",
        {
            "fabric": {
                "env": [{"value": "mlx5"}],
                "resources": {"limits": {RDMA: "one"}},
                "gpuResourceName": "a b",
            }
        },
    )
    paths = {issue.path for issue in validate_manifest(doc)}
    assert paths == {
        "spec.pods.fabric.env",
        "spec.pods.fabric.resources.limits.rdma/rdma_shared_device_a",
        "spec.pods.fabric.gpuResourceName",
    }
