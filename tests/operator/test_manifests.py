"""spec -> RayCluster manifest, as a pure function."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from rlhf_api.constants import POD_SLOTS_ENV
from rlhf_api.spec import RLHFJob
from rlhf_operator import manifests
from testkit.support import set_dotted

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]


def load(name: str, **overrides: Any) -> RLHFJob:
    doc = yaml.safe_load((ROOT / "examples" / name).read_text())
    doc["metadata"]["namespace"] = "team-a"
    return RLHFJob.model_validate(set_dotted(doc, overrides))


def group(rc: dict[str, Any], name: str) -> dict[str, Any]:
    return next(g for g in rc["spec"]["workerGroupSpecs"] if g["groupName"] == name)


def gpus(g: dict[str, Any]) -> int:
    return int(g["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"])


def test_llama_8b_sizes_trainer_and_rollout_groups() -> None:
    job = load("rlhfjob-llama-8b.yaml")
    rc = manifests.build_raycluster(job)
    spec = job.spec
    # Expected sizes worked out by hand from the example, not by the functions under test:
    # trainer: actor+reference on 2 nodes x 8 GPUs, critic+reward on 1 node x 8 GPUs -> 3 pods of 8 GPUs;
    # rollout: 4 engines x tensor parallel 2 = 8 GPUs, 4 GPUs per worker -> 2 pods of 4 GPUs.
    trainer = group(rc, "trainer")
    assert (trainer["replicas"], gpus(trainer)) == (3, 8)
    rollout = group(rc, "rollout")
    assert (rollout["replicas"], gpus(rollout)) == (2, 4)
    head = rc["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in head.get("resources", {}).get("limits", {})
    assert {"name": "rlhf-metrics", "containerPort": spec.monitoring.metrics_port} in head["ports"]


def test_a_job_without_an_image_gets_the_operators_default_and_its_own_wins() -> None:
    def images(rc: dict[str, Any]) -> set[str]:
        templates = [rc["spec"]["headGroupSpec"]["template"]] + [
            g["template"] for g in rc["spec"]["workerGroupSpecs"]
        ]
        return {c["image"] for t in templates for c in t["spec"]["containers"]}

    unnamed = load("rlhfjob-tiny.yaml")
    assert unnamed.spec.image is None
    assert images(manifests.build_raycluster(unnamed)) == {"ghcr.io/rlhf-operator/trainer:0.1.0"}
    assert images(manifests.build_raycluster(unnamed, default_image="reg.example/t:7")) == {"reg.example/t:7"}
    named = load("rlhfjob-tiny.yaml", **{"spec.image": "mine/trainer:1"})
    assert images(manifests.build_raycluster(named, default_image="reg.example/t:7")) == {"mine/trainer:1"}


def test_labels_propagate_to_cluster_and_pods() -> None:
    job = load(
        "rlhfjob-tiny.yaml", **{"metadata.labels": {"kueue.x-k8s.io/queue-name": "gpu-queue", "team": "a"}}
    )
    rc = manifests.build_raycluster(job)
    for labels in (rc["metadata"]["labels"], group(rc, "trainer")["template"]["metadata"]["labels"]):
        assert labels["kueue.x-k8s.io/queue-name"] == "gpu-queue"
        assert labels["team"] == "a"
        assert labels[manifests.JOB_LABEL] == "tiny"
    assert group(rc, "rollout")["template"]["metadata"]["labels"][manifests.ROLE_LABEL] == "rollout"


def test_rollout_pods_prefer_distinct_nodes_and_select_only_their_own_job() -> None:
    rc = manifests.build_raycluster(load("rlhfjob-tiny.yaml"))
    rollout = group(rc, "rollout")["template"]
    terms = rollout["spec"]["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    (term,) = terms
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    selector = term["podAffinityTerm"]["labelSelector"]["matchLabels"]
    # The selector must match the rollout pods themselves, and no pod of another job or role.
    assert selector.items() <= rollout["metadata"]["labels"].items()
    assert selector[manifests.JOB_LABEL] == "tiny" and selector[manifests.ROLE_LABEL] == "rollout"
    assert "affinity" not in group(rc, "trainer")["template"]["spec"]  # trainer pods pack as the spec says


def test_colocate_all_has_no_rollout_group() -> None:
    job = load("rlhfjob-tiny.yaml", **{"spec.trainer.colocateAll": True, "spec.trainer.actor.gpusPerNode": 1})
    rc = manifests.build_raycluster(job)
    assert [g["groupName"] for g in rc["spec"]["workerGroupSpecs"]] == ["trainer"]


def test_pod_overrides_are_applied() -> None:
    job = load(
        "rlhfjob-tiny.yaml",
        **{
            "spec.pods": {
                "nodeSelector": {"pool": "a100"},
                "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
                "serviceAccountName": "trainer",
                "resources": {"requests": {"memory": "64Gi"}},
            }
        },
    )
    rc = manifests.build_raycluster(job)
    pod = group(rc, "trainer")["template"]["spec"]
    assert pod["nodeSelector"] == {"pool": "a100"}
    assert pod["tolerations"][0]["key"] == "gpu"
    assert pod["serviceAccountName"] == "trainer"
    assert pod["containers"][0]["resources"]["requests"]["memory"] == "64Gi"


def pod_of(rc: dict[str, Any], role: str) -> dict[str, Any]:
    if role == "head":
        return dict(rc["spec"]["headGroupSpec"]["template"])
    return dict(group(rc, role)["template"])


def test_each_role_gets_its_own_settings_over_the_job_wide_defaults() -> None:
    job = load(
        "rlhfjob-tiny.yaml",
        **{
            "spec.pods": {
                "env": [{"name": "SHARED", "value": "1"}, {"name": "LEVEL", "value": "job"}],
                "tolerations": [{"key": "all", "operator": "Exists"}],
                "labels": {"team": "rl", "tier": "job"},
                "resources": {"requests": {"cpu": 2, "memory": "8Gi"}},
                "priorityClassName": "batch",
                "head": {"nodeSelector": {"pool": "cpu"}, "resources": {"requests": {"cpu": 1}}},
                "trainer": {
                    "nodeSelector": {"pool": "h100"},
                    "gpuResourceName": "amd.com/gpu",
                    "env": [{"name": "LEVEL", "value": "trainer"}],
                    "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
                    "labels": {"tier": "trainer"},
                    "containerSecurityContext": {"capabilities": {"drop": ["ALL"], "add": ["IPC_LOCK"]}},
                    "schedulerName": "gang",
                },
                "rollout": {
                    "envFrom": [{"secretRef": {"name": "hf-token"}}],
                    "affinity": {
                        "nodeAffinity": {
                            "requiredDuringSchedulingIgnoredDuringExecution": {
                                "nodeSelectorTerms": [
                                    {
                                        "matchExpressions": [
                                            {"key": "pool", "operator": "In", "values": ["l40s"]}
                                        ]
                                    }
                                ]
                            }
                        }
                    },
                },
            }
        },
    )
    rc = manifests.build_raycluster(job)
    head, trainer, rollout = (pod_of(rc, r) for r in ("head", "trainer", "rollout"))
    hc, tc, rc_ = (p["spec"]["containers"][0] for p in (head, trainer, rollout))
    # Maps merge key by key; the role wins.
    assert head["spec"]["nodeSelector"] == {"pool": "cpu"}
    assert trainer["spec"]["nodeSelector"] == {"pool": "h100"}
    assert "nodeSelector" not in rollout["spec"]
    assert hc["resources"] == {"requests": {"cpu": 1, "memory": "8Gi"}}
    assert (
        trainer["metadata"]["labels"]["tier"] == "trainer" and trainer["metadata"]["labels"]["team"] == "rl"
    )
    assert rollout["metadata"]["labels"]["tier"] == "job"
    # GPUs under the role's resource name; the head asks for none.
    # (The tiny example's trainer pod holds 2 ranks, one "GPU" each.)
    assert tc["resources"]["limits"] == {"amd.com/gpu": "2"} and tc["resources"]["requests"]["cpu"] == 2
    assert not any("gpu" in k for k in hc["resources"]["requests"])
    # env merges by name (the role's LEVEL replaces the job's, in place); tolerations add up.
    assert [(e["name"], e.get("value")) for e in tc["env"][5:]] == [("SHARED", "1"), ("LEVEL", "trainer")]
    assert [(e["name"], e.get("value")) for e in rc_["env"][5:]] == [("SHARED", "1"), ("LEVEL", "job")]
    assert [t["key"] for t in trainer["spec"]["tolerations"]] == ["all", "gpu"]
    assert rc_["envFrom"] == [{"secretRef": {"name": "hf-token"}}] and "envFrom" not in tc
    # Strings: the role's replaces the job's.
    assert trainer["spec"]["schedulerName"] == "gang" and "schedulerName" not in head["spec"]
    assert {p["spec"]["priorityClassName"] for p in (head, trainer, rollout)} == {"batch"}
    # A rollout affinity of the job's own replaces the default spread.
    assert list(rollout["spec"]["affinity"]) == ["nodeAffinity"]
    # Security: restricted defaults everywhere; the trainer's capability is its own.
    assert tc["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
    assert hc["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert tc["securityContext"]["allowPrivilegeEscalation"] is False


def test_pods_pass_the_restricted_profile_by_default() -> None:
    """Each field the restricted Pod Security Standard checks, on every role's pod. (The cluster test
    runs the job in a namespace that enforces the profile; this names the fields.)"""
    rc = manifests.build_raycluster(load("rlhfjob-tiny.yaml"))
    for role in ("head", "trainer", "rollout"):
        spec = pod_of(rc, role)["spec"]
        pod_sc, [container] = spec["securityContext"], spec["containers"]
        assert pod_sc["runAsNonRoot"] is True and pod_sc["runAsUser"] == 10001, role
        assert pod_sc["seccompProfile"] == {"type": "RuntimeDefault"}, role
        assert container["securityContext"] == {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
        }, role
        assert all(
            set(v) <= {"name", "emptyDir", "persistentVolumeClaim", "configMap", "secret"}
            for v in spec["volumes"]
        )
        shm = [m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm"]
        assert len(shm) == 1, role


def test_a_job_mount_at_dev_shm_replaces_the_default_one() -> None:
    job = load(
        "rlhfjob-tiny.yaml",
        **{
            "spec.pods": {
                "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "64Gi"}}],
                "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
            }
        },
    )
    spec = pod_of(manifests.build_raycluster(job), "trainer")["spec"]
    assert [v["name"] for v in spec["volumes"]] == ["dshm"]
    assert [m["name"] for m in spec["containers"][0]["volumeMounts"]] == ["dshm"]


def test_engines_are_clamped_to_the_autoscaling_range() -> None:
    job = load(
        "rlhfjob-tiny.yaml",
        **{
            "spec.rollout.autoscaling": {"enabled": True, "minEngines": 1, "maxEngines": 2},
            "spec.rollout.engines": 2,
        },
    )
    assert manifests.effective_engines(job.spec) == 2
    rc = manifests.build_raycluster(job, engines=2)
    assert group(rc, "rollout")["replicas"] == 2
    assert group(rc, "rollout")["maxReplicas"] >= 2


def test_scale_patch_only_when_replicas_change() -> None:
    rc = manifests.build_raycluster(load("rlhfjob-tiny.yaml"))
    current = group(rc, "rollout")["replicas"]
    assert manifests.scale_patch(rc, current) is None
    ops = manifests.scale_patch(rc, current + 3)
    assert ops is not None
    assert {"op": "replace", "path": "/spec/workerGroupSpecs/1/replicas", "value": current + 3} in ops


def test_names_and_submission_ids_are_deterministic() -> None:
    job = load("rlhfjob-tiny.yaml")
    assert manifests.raycluster_name("tiny") == "tiny"
    long = "x" * 60
    assert manifests.raycluster_name(long) == manifests.raycluster_name(long)
    assert len(manifests.raycluster_name(long)) <= 40
    a = manifests.submission_id(job, "0123456789abcdef", 0)
    assert a == manifests.submission_id(job, "0123456789abcdef", 0)
    assert a != manifests.submission_id(job, "0123456789abcdef", 1)


def test_runtime_env_carries_the_spec_round_trip() -> None:
    job = load("rlhfjob-tiny.yaml")
    env = manifests.trainer_runtime_env(job)["env_vars"]
    from rlhf_api.spec import RLHFJobSpec

    assert RLHFJobSpec.model_validate_json(env["RLHF_SPEC_JSON"]) == job.spec
    assert env["RLHF_JOB_NAME"] == "tiny"


def test_runtime_env_carries_literal_pod_env_but_never_overrides_the_spec() -> None:
    pod_env = [
        {"name": "HF_HUB_OFFLINE", "value": "1"},
        {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}},
        {"name": "RLHF_JOB_NAME", "value": "spoofed"},
    ]
    job = load("rlhfjob-tiny.yaml", **{"spec.pods.env": pod_env})
    env = manifests.trainer_runtime_env(job)["env_vars"]
    assert env["HF_HUB_OFFLINE"] == "1"
    assert "TOKEN" not in env  # a secret reference exists only in the pods
    assert env["RLHF_JOB_NAME"] == "tiny"


def test_a_job_in_its_own_raycluster_tells_its_driver_that_pods_advertise_their_slots() -> None:
    """RLHF_POD_SLOTS: set for the operator's RayCluster (its pods advertise rlhf_*_slot), unset under the
    development override (a local Ray head advertises none)."""
    job = load("rlhfjob-tiny.yaml")
    assert manifests.trainer_runtime_env(job, pod_slots=True)["env_vars"][POD_SLOTS_ENV] == "1"
    assert POD_SLOTS_ENV not in manifests.trainer_runtime_env(job)["env_vars"]


def test_head_url_is_the_kuberay_head_service_or_the_development_host() -> None:
    cluster = {"metadata": {"name": "ppo", "namespace": "team-a"}}
    assert manifests.head_url(cluster, 8265) == "http://ppo-head-svc.team-a.svc:8265"
    named = {**cluster, "status": {"head": {"serviceName": "ppo-head-x"}}}  # KubeRay's own report wins
    assert manifests.head_url(named, 9400) == "http://ppo-head-x.team-a.svc:9400"
    assert manifests.head_url(named, 18265, dev_host="127.0.0.1") == "http://127.0.0.1:18265"
    assert manifests.head_url(None, 8265, dev_host="127.0.0.1") == "http://127.0.0.1:8265"
    with pytest.raises(ValueError, match="no RayCluster"):
        manifests.head_url(None, 8265)


def test_effective_engines_clamp_a_request_outside_the_range_only_under_autoscaling() -> None:
    autoscaling = {"enabled": True, "minEngines": 2, "maxEngines": 3}
    for requested, expected in ((1, 2), (3, 3), (9, 3)):
        job = load(
            "rlhfjob-tiny.yaml",
            **{"spec.rollout.autoscaling": autoscaling, "spec.rollout.engines": requested},
        )
        assert manifests.effective_engines(job.spec) == expected, requested
    assert manifests.effective_engines(load("rlhfjob-tiny.yaml", **{"spec.rollout.engines": 9}).spec) == 9


def test_ray_start_gets_each_groups_resources_as_one_json_argument() -> None:
    """KubeRay builds `ray start ... --resources=VALUE` by pasting VALUE into a bash line; unquoted JSON
    with a space split into two words and every worker pod crashed (`Got unexpected extra argument`)."""
    import json
    import shlex

    rc = manifests.build_raycluster(load("rlhfjob-tiny.yaml"), default_image="img")
    for group in rc["spec"]["workerGroupSpecs"]:
        params = group["rayStartParams"]
        line = "ray start " + "".join(f" --{k}={v} " for k, v in sorted(params.items()))  # KubeRay's format
        words = shlex.split(line)
        (arg,) = [w for w in words if w.startswith("--resources=")]
        resources = json.loads(arg.removeprefix("--resources="))
        ((name, amount),) = resources.items()
        assert name == f"rlhf_{group['groupName']}_slot" and amount >= 1


def test_each_role_stops_by_its_own_prestop_hook_rollout_pods_drain_their_ray_node() -> None:
    """The head's hook stops the driver (rlhf_trainer.preempt); a rollout pod's drains its Ray node for
    the grace period, so the trainer retires its engine between phases (rlhf_trainer.drain); the trainer
    pods have none (losing one restarts the attempt anyway)."""
    job = load("rlhfjob-tiny.yaml", **{"spec.runPolicy.terminationGracePeriodSeconds": 45})
    rc = manifests.build_raycluster(job)

    def hook(template: dict[str, Any]) -> list[str] | None:
        lifecycle = template["spec"]["containers"][0].get("lifecycle")
        return lifecycle["preStop"]["exec"]["command"] if lifecycle else None

    assert hook(rc["spec"]["headGroupSpec"]["template"]) == ["python", "-m", "rlhf_trainer.preempt"]
    drain = ["python", "-m", "rlhf_trainer.drain", "--deadline-seconds", "45"]
    assert hook(group(rc, "rollout")["template"]) == drain
    assert hook(group(rc, "trainer")["template"]) is None


def test_resources_per_gpu_scale_with_each_pods_gpus_under_the_pods_own_resources() -> None:
    """A runtime's per-GPU resources (it cannot know each job's GPU count) become each pod's: the tiny
    example's trainer pods have 2 GPUs (its actor's), its rollout pod 1, the head none; `resources`
    keeps its own keys."""
    per_gpu = {"requests": {"cpu": 12, "memory": "120Gi"}, "limits": {"memory": "120Gi"}}
    job = load(
        "rlhfjob-tiny.yaml",
        **{
            "spec.pods.resourcesPerGpu": per_gpu,
            "spec.pods.rollout": {"resources": {"requests": {"cpu": 4}}},
        },
    )
    rc = manifests.build_raycluster(job)
    trainer = group(rc, "trainer")["template"]["spec"]["containers"][0]["resources"]
    assert trainer["requests"]["cpu"] == "24" and trainer["requests"]["memory"] == "240Gi", trainer
    assert trainer["limits"]["memory"] == "240Gi" and trainer["limits"]["nvidia.com/gpu"] == "2", trainer
    rollout = group(rc, "rollout")["template"]["spec"]["containers"][0]["resources"]
    assert rollout["requests"]["cpu"] == 4 and rollout["requests"]["memory"] == "120Gi", rollout
    head = rc["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0].get("resources", {})
    assert "cpu" not in head.get("requests", {}) and "memory" not in head.get("limits", {}), head


def test_every_container_reads_the_object_store_credentials_from_the_secret_never_in_clear() -> None:
    """spec.storage.s3.credentialsSecret: each pod (the head too, where the driver runs) gets the AWS
    variables by secretKeyRef, the two keys required and the rest optional; the Ray job's env and the
    RayCluster hold no value of them; without spec.storage.s3 no pod gets them."""
    job = load("rlhfjob-tiny.yaml", **{"spec.storage.s3.credentialsSecret": "store-keys"})
    rc = manifests.build_raycluster(job)
    templates = [rc["spec"]["headGroupSpec"]["template"]] + [
        g["template"] for g in rc["spec"]["workerGroupSpecs"]
    ]
    assert len(templates) == 3
    for template in templates:
        env = {e["name"]: e for e in template["spec"]["containers"][0]["env"]}
        refs = {k: env[k]["valueFrom"]["secretKeyRef"] for k in env if k.startswith("AWS_")}
        assert refs == {
            "AWS_ACCESS_KEY_ID": {"name": "store-keys", "key": "AWS_ACCESS_KEY_ID", "optional": False},
            "AWS_SECRET_ACCESS_KEY": {
                "name": "store-keys",
                "key": "AWS_SECRET_ACCESS_KEY",
                "optional": False,
            },
            "AWS_ENDPOINT_URL": {"name": "store-keys", "key": "AWS_ENDPOINT_URL", "optional": True},
            "AWS_REGION": {"name": "store-keys", "key": "AWS_REGION", "optional": True},
            "AWS_SESSION_TOKEN": {"name": "store-keys", "key": "AWS_SESSION_TOKEN", "optional": True},
        }
        assert all("value" not in env[k] for k in refs)
    assert not any(k.startswith("AWS_") for k in manifests.trainer_runtime_env(job)["env_vars"])
    plain = manifests.build_raycluster(load("rlhfjob-tiny.yaml"))
    assert "AWS_ACCESS_KEY_ID" not in json.dumps(plain)
