"""A job merged over its runtime (rlhf_api.runtime_merge), field by field, on the job as the API server
stores it (every CRD default filled in, `with_crd_defaults`): what counts as set, what the runtime keeps,
how each kind of field merges, where storage goes; and what the runtime model itself refuses."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError
from rlhf_api import pod_settings
from rlhf_api.rules import violated
from rlhf_api.runtime_merge import (
    MergeError,
    allowed,
    asks_gpus,
    deep_merge,
    merge,
    set_fields,
    with_crd_defaults,
)
from rlhf_api.runtime_spec import RLHFRuntimeSpec, runtime_violations
from rlhf_api.spec import RLHFJobSpec

pytestmark = [pytest.mark.unit, pytest.mark.runtime]

REF = "ClusterRLHFRuntime/rt"
JOB, NAMESPACE = "ppo", "team-a"
STORAGE = {
    "modelCache": {"mountPath": "/models", "claimName": "rlhf-models", "readOnly": True},
    "checkpoints": {"mountPath": "/checkpoints", "claimTemplate": {"size": "10Gi"}},
}
GPU_TAINT = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}


def _spec_as_written(**sections: Any) -> dict[str, Any]:
    """A job spec as written: the required fields, a runtimeRef and `sections` over them."""
    spec: dict[str, Any] = {
        "runtimeRef": {"name": "rt"},
        "model": {"actor": "/models/a", "reward": {"type": "function", "function": "r:f"}},
        "data": {"prompts": "/data/p.jsonl"},
    }
    return deep_merge(spec, sections)


def runtime(**spec: Any) -> RLHFRuntimeSpec:
    return RLHFRuntimeSpec.model_validate(spec)


def merged(spec: dict[str, Any], rt: RLHFRuntimeSpec) -> RLHFJobSpec:
    """The merged spec as the operator validates it, from the stored job."""
    return RLHFJobSpec.model_validate(merge(with_crd_defaults(spec), rt, REF, JOB, NAMESPACE).spec)


def refused(spec: dict[str, Any], rt: RLHFRuntimeSpec) -> MergeError:
    with pytest.raises(MergeError) as caught:
        merge(with_crd_defaults(spec), rt, REF, JOB, NAMESPACE)
    return caught.value


# ---- the stored job and what counts as set ------------------------------------------------------------


def test_the_stored_job_has_every_default_the_model_has() -> None:
    written = _spec_as_written(trainer={"actor": {"gpusPerNode": 2}})
    stored = with_crd_defaults(deep_merge(written, {"rollout": {"engines": None}}))
    assert stored["algorithm"]["async"]["enabled"] is False  # inside a section the job did not write
    assert stored["model"]["reward"]["onError"] == "failStep"  # inside an object the job wrote
    assert stored["trainer"]["actor"] == {"gpusPerNode": 2, "nodes": 1}
    assert stored["rollout"]["engines"] == 1  # a null is pruned, then defaulted
    assert RLHFJobSpec.model_validate(stored) == RLHFJobSpec.model_validate(written)


def test_only_fields_that_differ_from_their_default_are_set() -> None:
    stored = with_crd_defaults(
        _spec_as_written(algorithm={"klCoef": 0.01, "epochs": 2}, runPolicy={"backoffLimit": 3})
    )
    assert dict(set_fields(stored)) == {
        ("runtimeRef", "name"): "rt",
        ("model", "actor"): "/models/a",
        ("model", "reward", "type"): "function",
        ("model", "reward", "function"): "r:f",
        ("data", "prompts"): "/data/p.jsonl",
        ("algorithm", "epochs"): 2,
    }


def test_a_field_equal_to_its_default_leaves_the_runtimes_value() -> None:
    rt = runtime(jobDefaults={"runPolicy": {"backoffLimit": 1}})
    assert (
        merged(_spec_as_written(runPolicy={"backoffLimit": 3}), rt).run_policy.backoff_limit == 1
    )  # 3: the default
    assert merged(_spec_as_written(runPolicy={"backoffLimit": 5}), rt).run_policy.backoff_limit == 5


def test_an_optional_object_the_job_wrote_is_set_even_at_its_fields_defaults() -> None:
    """trainer.critic has no default: written as {1, 1} it must stay, not become the actor's placement."""
    spec = _spec_as_written(
        algorithm={"advantageEstimator": "gae"},
        model={"critic": "/models/c"},
        trainer={"actor": {"gpusPerNode": 2}, "critic": {"nodes": 1, "gpusPerNode": 1}},
    )
    critic = merged(spec, runtime()).trainer.critic
    assert critic is not None and (critic.nodes, critic.gpus_per_node) == (1, 1)


# ---- what a job may set -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sections", "path"),
    [
        ({"algorithm": {"klCoef": 0.05}}, "spec.algorithm.klCoef"),
        ({"rayVersion": "2.50.0"}, "spec.rayVersion"),
        ({"image": "mine:1"}, "spec.image"),
        ({"security": {"networkPolicy": "Disabled"}}, "spec.security.networkPolicy"),
    ],
)
def test_a_set_field_outside_overridable_is_refused_naming_it_and_the_runtime(
    sections: dict[str, Any], path: str
) -> None:
    error = refused(
        _spec_as_written(**sections), runtime(images={"cpu": "cpu:1"}, overridable=["model", "data"])
    )
    assert error.path == path
    assert REF in error.message and "overridable" in error.message


def test_the_default_overridable_keeps_the_infrastructure() -> None:
    error = refused(_spec_as_written(pods={"trainer": {"nodeSelector": {"pool": "mine"}}}), runtime())
    assert error.path == "spec.pods.trainer.nodeSelector"
    assert merged(_spec_as_written(algorithm={"klCoef": 0.05}), runtime()).algorithm.kl_coef == 0.05


def test_a_kept_field_equal_to_the_runtimes_own_value_is_accepted() -> None:
    rt = runtime(
        rayVersion="2.50.0",
        images={"cpu": "cpu:1"},
        jobDefaults={"security": {"networkPolicy": "Disabled"}},
        pods={"trainer": {"tolerations": [GPU_TAINT]}},
    )
    spec = merged(
        _spec_as_written(
            rayVersion="2.50.0",
            image="cpu:1",
            security={"networkPolicy": "Disabled"},
            pods={"trainer": {"tolerations": [GPU_TAINT]}},
        ),
        rt,
    )
    assert (spec.ray_version, spec.image, spec.security.network_policy) == ("2.50.0", "cpu:1", "Disabled")
    assert pod_settings.for_role(spec.pods, "trainer").tolerations == [GPU_TAINT]  # not added twice


def test_a_sub_path_entry_allows_that_field_and_not_its_siblings() -> None:
    rt = runtime(overridable=["model", "data", "rollout.temperature"])
    assert merged(_spec_as_written(rollout={"temperature": 0.7}), rt).rollout.temperature == 0.7
    assert (
        refused(_spec_as_written(rollout={"temperature": 0.7, "topP": 0.9}), rt).path == "spec.rollout.topP"
    )
    assert not allowed(("rollout", "temperatureMax"), ["rollout.temperature"])  # a path, not a prefix


def test_runtime_ref_and_the_engine_count_are_always_the_jobs() -> None:
    """rollout.engines is the scale subresource's: kubectl scale and the autoscaler write it later."""
    rt = runtime(overridable=["model", "data"])
    spec = merged(
        _spec_as_written(runtimeRef={"kind": "RLHFRuntime", "name": "rt"}, rollout={"engines": 4}), rt
    )
    assert spec.runtime_ref is not None and spec.runtime_ref.kind == "RLHFRuntime"
    assert spec.rollout.engines == 4


# ---- how fields merge ---------------------------------------------------------------------------------


def test_job_defaults_lie_under_the_jobs_fields_maps_merge_and_the_rest_replaces() -> None:
    rt = runtime(jobDefaults={"monitoring": {"stallTimeoutSeconds": 600, "onStall": "Alert"}})
    spec = merged(_spec_as_written(monitoring={"stallTimeoutSeconds": 900}), rt)
    assert (spec.monitoring.stall_timeout_seconds, spec.monitoring.on_stall) == (900, "Alert")
    assert deep_merge({"a": {"b": 1, "c": [1, 2]}}, {"a": {"c": [3]}}) == {"a": {"b": 1, "c": [3]}}


def test_the_platforms_fields_win_over_the_runtimes_own_job_defaults() -> None:
    """The storage's checkpoint path over jobDefaults.checkpoint.path; the rest of jobDefaults holds."""
    rt = runtime(
        rayVersion="2.55.0",
        images={"cpu": "cpu:1"},
        storage={"checkpoints": {"mountPath": "/ckpt", "claimName": "ckpt"}},
        jobDefaults={"checkpoint": {"path": "/elsewhere", "keepLast": 5}},
    )
    spec = merged(_spec_as_written(), rt)
    assert (spec.ray_version, spec.image) == ("2.55.0", "cpu:1")
    assert (spec.checkpoint.path, spec.checkpoint.keep_last) == (f"/ckpt/{NAMESPACE}/{JOB}", 5)


@pytest.mark.parametrize("field", ["image", "rayVersion", "pods", "runtimeRef"])
def test_job_defaults_hold_no_field_the_runtime_has_its_own(field: str) -> None:
    """One place for each: images, rayVersion and pods are the runtime's own fields (the CRD's jobDefaults
    schema has none of them), and runtimeRef is the job's."""
    with pytest.raises(ValidationError, match=f"{field} is not a job default"):
        runtime(jobDefaults={field: {"name": "x"} if field != "image" else "x:1"})


def test_pods_merge_by_the_rules_of_spec_pods() -> None:
    rt = runtime(
        overridable=["model", "data", "pods"],
        pods={
            "trainer": {
                "nodeSelector": {"pool": "h100"},
                "tolerations": [GPU_TAINT],
                "env": [{"name": "A", "value": "1"}, {"name": "B", "value": "1"}],
            }
        },
    )
    mine = {"key": "team", "operator": "Exists"}
    spec = merged(
        _spec_as_written(
            pods={
                "trainer": {
                    "nodeSelector": {"zone": "a"},
                    "tolerations": [mine],
                    "env": [{"name": "A", "value": "2"}, {"name": "C", "value": "3"}],
                }
            }
        ),
        rt,
    )
    trainer = pod_settings.for_role(spec.pods, "trainer")
    assert trainer.node_selector == {"pool": "h100", "zone": "a"}
    assert trainer.tolerations == [GPU_TAINT, mine]
    assert [(e["name"], e["value"]) for e in trainer.env or []] == [("A", "2"), ("B", "1"), ("C", "3")]


def test_the_fabric_reaches_trainer_and_rollout_pods_never_the_head() -> None:
    nccl = {"name": "NCCL_IB_HCA", "value": "mlx5"}
    rt = runtime(pods={"fabric": {"env": [nccl], "resources": {"limits": {"rdma/ib": 1}}}}, storage=STORAGE)
    pods = merged(_spec_as_written(), rt).pods
    for role in ("trainer", "rollout"):
        settings = pod_settings.for_role(pods, role)
        assert settings.env == [nccl] and settings.resources is not None, role
        assert settings.resources.limits == {"rdma/ib": 1}, role
    head = pod_settings.for_role(pods, "head")
    assert head.env is None and head.resources is None


# ---- the image ----------------------------------------------------------------------------------------


def test_the_jobs_image_wins_where_the_runtime_allows_it() -> None:
    rt = runtime(images={"cpu": "cpu:1", "gpu": "gpu:1"}, overridable=["model", "data", "image"])
    assert merged(_spec_as_written(image="mine:1"), rt).image == "mine:1"


def test_a_job_whose_pods_get_gpus_gets_the_gpu_image_unless_the_gpus_are_a_stand_in() -> None:
    """Every placement has gpusPerNode >= 1, so every valid job's pods get GPUs: with both images set, the
    GPU one; on a cluster whose GPUs are the operator's named CPU stand-in, the CPU one."""
    rt = runtime(images={"cpu": "cpu:1", "gpu": "gpu:1"})
    spec = merged(_spec_as_written(), rt)
    assert asks_gpus(spec) and spec.image == "gpu:1"
    stored = with_crd_defaults(_spec_as_written())
    standin = merge(stored, rt, "ClusterRLHFRuntime/rt", "tiny", "ns", gpu_standin=True).spec
    assert standin["image"] == "cpu:1"


@pytest.mark.parametrize("images", [{"cpu": "only:1"}, {"gpu": "only:1"}])
def test_the_only_image_is_every_jobs(images: dict[str, str]) -> None:
    assert merged(_spec_as_written(), runtime(images=images)).image == "only:1"


def test_no_images_leave_the_operators_default() -> None:
    assert merged(_spec_as_written(), runtime()).image is None


# ---- storage ------------------------------------------------------------------------------------------


def test_storage_is_mounted_in_every_pod_and_the_model_cache_read_only() -> None:
    merge_ = merge(with_crd_defaults(_spec_as_written()), runtime(storage=STORAGE), REF, JOB, NAMESPACE)
    pods = RLHFJobSpec.model_validate(merge_.spec).pods
    for role in pod_settings.POD_ROLES:
        settings = pod_settings.for_role(pods, role)
        volumes = {v["name"]: v["persistentVolumeClaim"] for v in settings.volumes or []}
        mounts = {m["mountPath"]: m for m in settings.volume_mounts or []}
        assert volumes == {
            "model-cache": {"claimName": "rlhf-models", "readOnly": True},
            "checkpoints": {"claimName": f"{JOB}-checkpoints"},
        }, role
        assert mounts["/models"].get("readOnly") is True and "readOnly" not in mounts["/checkpoints"], role
    assert merge_.checkpoint_claim == f"{JOB}-checkpoints"


def test_checkpoints_go_under_namespace_and_job_unless_the_job_says_where() -> None:
    rt = runtime(storage=STORAGE)
    assert merged(_spec_as_written(), rt).checkpoint.path == f"/checkpoints/{NAMESPACE}/{JOB}"
    assert (
        merged(_spec_as_written(checkpoint={"path": "/checkpoints/mine"}), rt).checkpoint.path
        == "/checkpoints/mine"
    )


def test_an_export_upload_takes_its_path_from_the_runtimes_checkpoint_volume() -> None:
    """Admission lets checkpoint.exportTo through without checkpoint.path on a runtime-bound job (the
    runtime's checkpoint volume gives the path); a runtime without one is refused at the merge, by name."""
    upload = _spec_as_written(
        storage={"s3": {"credentialsSecret": "s3"}}, checkpoint={"exportTo": "s3://models/run-1"}
    )
    assert not [r.name for r in violated(RLHFJobSpec.model_validate(upload))]
    spec = merged(upload, runtime(storage=STORAGE))
    assert spec.checkpoint.export_dir() == f"/checkpoints/{NAMESPACE}/{JOB}/model"
    e = refused(upload, runtime(storage={"modelCache": STORAGE["modelCache"]}))
    assert e.path == "spec.checkpoint.exportTo" and "no checkpoint volume" in str(e), e
    alone = {k: v for k, v in upload.items() if k != "runtimeRef"}
    assert [r.name for r in violated(RLHFJobSpec.model_validate(alone))] == ["export-to-needs-an-export"]


def test_a_remote_model_is_fetched_into_the_runtimes_writable_model_cache() -> None:
    """A runtime-bound job names an s3:// model and its own object store's Secret; the runtime's model
    cache (writable) becomes storage.modelCache; a read-only or missing cache is refused naming the model."""
    remote = _spec_as_written(
        model={"actor": "s3://team-models/tiny"}, storage={"s3": {"credentialsSecret": "s3"}}
    )
    assert not [r.name for r in violated(RLHFJobSpec.model_validate(remote))]
    writable = {**STORAGE, "modelCache": {**STORAGE["modelCache"], "readOnly": False}}
    cache = merged(remote, runtime(storage=writable)).storage.model_cache
    assert cache is not None and (cache.claim_name, cache.mount_path) == ("rlhf-models", "/models")
    for storage in (STORAGE, {"checkpoints": STORAGE["checkpoints"]}):
        e = refused(remote, runtime(storage=storage))
        assert e.path == "spec.model.actor" and "no writable storage.modelCache" in str(e), e
    assert (
        merged(_spec_as_written(), runtime(storage=STORAGE)).storage.model_cache is None
    )  # read-only: paths only


def test_a_shared_checkpoint_claim_makes_no_claim_per_job() -> None:
    rt = runtime(storage={"checkpoints": {"mountPath": "/ckpt", "claimName": "shared"}})
    merge_ = merge(with_crd_defaults(_spec_as_written()), rt, REF, JOB, NAMESPACE)
    assert merge_.checkpoint_claim is None
    assert merge_.spec["pods"]["volumes"] == [
        {"name": "checkpoints", "persistentVolumeClaim": {"claimName": "shared"}}
    ]


@pytest.mark.parametrize(
    ("pods", "path"),
    [
        ({"volumes": [{"name": "checkpoints", "emptyDir": {}}]}, "spec.pods.volumes[0].name"),
        (
            {"trainer": {"volumeMounts": [{"name": "mine", "mountPath": "/models"}]}},
            "spec.pods.trainer.volumeMounts[0].mountPath",
        ),
    ],
)
def test_a_job_cannot_replace_the_runtimes_storage(pods: dict[str, Any], path: str) -> None:
    rt = runtime(storage=STORAGE, overridable=["model", "data", "pods"])
    assert refused(_spec_as_written(pods=pods), rt).path == path


# ---- the runtime model --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("storage", "rule"),
    [
        ({"checkpoints": {"mountPath": "/c"}}, "checkpoints-one-claim"),
        (
            {"checkpoints": {"mountPath": "/c", "claimName": "c", "claimTemplate": {"size": "1Gi"}}},
            "checkpoints-one-claim",
        ),
        ({"modelCache": {"mountPath": "/m", "claimTemplate": {"size": "1Gi"}}}, "model-cache-shared-claim"),
    ],
)
def test_runtime_rules_refuse_ambiguous_storage(storage: dict[str, Any], rule: str) -> None:
    assert [r.name for r in runtime_violations(runtime(storage=storage))] == [rule]


def test_runtime_rules_accept_the_two_kinds_of_claim() -> None:
    assert runtime_violations(runtime(storage=STORAGE)) == []


def test_overridable_names_only_spec_fields() -> None:
    assert runtime(overridable=["rollout.engines", "pods.trainer.nodeSelector.pool"]).allowed()
    with pytest.raises(ValidationError, match="not a field of the RLHFJob spec"):
        runtime(overridable=["algorithm.klCoeff"])
