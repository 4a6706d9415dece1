"""The fetch step in the RayCluster: an init container `fetch-models` on the head pod (the head's image,
security context, env and mounts) fetching exactly the job's remote models, the cache claim mounted at one
path in every container, and the Hub token only by secretKeyRef in that init container."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from rlhf_api.spec import RLHFJob
from rlhf_operator import manifests
from testkit.support import set_dotted

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
REMOTE = {
    "spec.model.actor": "hf://org/actor@v1",
    "spec.storage.huggingFace.tokenSecret": "hub-token",
    "spec.storage.s3.credentialsSecret": "store-keys",
    "spec.storage.modelCache.claimName": "models",
    "spec.storage.modelCache.mountPath": "/mc",
}


def load(**overrides: Any) -> RLHFJob:
    doc = yaml.safe_load((ROOT / "examples" / "rlhfjob-tiny.yaml").read_text())
    doc["metadata"]["namespace"] = "team-a"
    return RLHFJob.model_validate(set_dotted(doc, overrides))


def templates(rc: dict[str, Any]) -> list[dict[str, Any]]:
    return [rc["spec"]["headGroupSpec"]["template"]] + [g["template"] for g in rc["spec"]["workerGroupSpecs"]]


def test_the_head_fetches_the_remote_models_before_ray_starts() -> None:
    job = load(**REMOTE, **{"spec.model.reward": {"type": "model", "model": "s3://team/rm"}})
    head = manifests.build_raycluster(job)["spec"]["headGroupSpec"]["template"]["spec"]
    (fetch,) = head["initContainers"]
    ray = head["containers"][0]
    assert fetch["name"] == "fetch-models"
    assert fetch["command"] == [
        "python", "-m", "rlhf_trainer.fetch_models", "--cache", "/mc",
        "--source", "model.actor=hf://org/actor@v1", "--source", "model.reward.model=s3://team/rm",
    ]  # fmt: skip
    assert (fetch["image"], fetch["securityContext"]) == (ray["image"], ray["securityContext"])
    assert fetch["volumeMounts"] == ray["volumeMounts"]
    env = {e["name"]: e for e in fetch["env"]}
    assert env["HF_TOKEN"] == {
        "name": "HF_TOKEN",
        "valueFrom": {"secretKeyRef": {"name": "hub-token", "key": "HF_TOKEN"}},
    }
    assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "store-keys"
    assert "HF_TOKEN" not in {e["name"] for e in ray["env"]}  # the token goes to the fetch step only


def test_every_container_mounts_the_cache_claim_at_one_path() -> None:
    rc = manifests.build_raycluster(load(**REMOTE))
    for template in templates(rc):
        spec = template["spec"]
        assert {"name": "rlhf-model-cache", "persistentVolumeClaim": {"claimName": "models"}} in spec[
            "volumes"
        ]
        for container in spec["containers"] + spec.get("initContainers", []):
            assert {"name": "rlhf-model-cache", "mountPath": "/mc"} in container["volumeMounts"]


def test_no_fetch_step_when_every_model_is_a_path() -> None:
    cached_paths = load(**{"spec.storage.modelCache.claimName": "models"})
    rc = manifests.build_raycluster(cached_paths)
    assert "initContainers" not in rc["spec"]["headGroupSpec"]["template"]["spec"]
    assert "fetch-models" not in json.dumps(manifests.build_raycluster(load()))


def test_the_token_never_appears_in_clear() -> None:
    rc = json.dumps(manifests.build_raycluster(load(**REMOTE)))
    assert '"HF_TOKEN", "value"' not in rc and "hub-token" in rc
    assert "HF_TOKEN" not in json.dumps(manifests.trainer_runtime_env(load(**REMOTE)))


def test_a_cache_already_mounted_there_is_not_mounted_twice() -> None:
    """A runtime's model-cache volume (or the job's own mount) at the cache's path: no second mount."""
    own = {
        "spec.pods.volumes": [{"name": "model-cache", "persistentVolumeClaim": {"claimName": "models"}}],
        "spec.pods.volumeMounts": [{"name": "model-cache", "mountPath": "/mc"}],
    }
    head = manifests.build_raycluster(load(**REMOTE, **own))["spec"]["headGroupSpec"]["template"]["spec"]
    for container in head["containers"] + head["initContainers"]:
        assert [m["name"] for m in container["volumeMounts"] if m["mountPath"] == "/mc"] == ["model-cache"]
    assert "rlhf-model-cache" not in json.dumps(head)
