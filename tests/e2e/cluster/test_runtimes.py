"""Jobs on platform runtimes against the real API server, KubeRay and the operator (docs/runtimes.md).

The pods are KWOK's: what is under test is what the pods are made of (read back from the pods KubeRay
created), which runtime generation a job uses, how a job that cannot run on its runtime fails, and the
per-job checkpoint claim's life. No trainer runs here (no Ray head: the operator's Jobs API calls fail
and are retried, which changes nothing of the above); the tiny job in real pods through a runtime is the
real-node test's (tests/e2e/realnode).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from rlhf_api import admission, crd
from rlhf_api.runtime_spec import (
    CLUSTER_KIND,
    DEFAULT_OVERRIDABLE,
    NAMESPACED_KIND,
    RLHFRuntimeSpec,
    runtime_violations,
)
from testkit.support import Cluster, OperatorProcess, example_job, phase_is, wait_for

pytestmark = pytest.mark.runtime

GPU_IMAGE, CPU_IMAGE = "registry.example/trainer:gpu-1", "registry.example/trainer:cpu-1"


@pytest.fixture
def op(cluster: Cluster, rlhf_crd: str, namespace: str, tmp_path: Path) -> Iterator[OperatorProcess]:
    """The operator watching this test's namespace only (no Ray head: nothing here runs a trainer)."""
    proc = OperatorProcess(cluster, tmp_path / "operator.log", namespaces=[namespace])
    proc.start()
    yield proc
    proc.stop()
    print(f"--- operator log tail ---\n{proc.log_tail()}")


@pytest.fixture
def runtime_name(cluster: Cluster) -> Iterator[str]:
    """A cluster-scoped runtime's name, unique to the test; the runtime is deleted afterwards."""
    name = f"rt-{uuid.uuid4().hex[:6]}"
    yield name
    cluster.kubectl("delete", "clusterrlhfruntime", name, "--wait=false", check=False)


def runtime(name: str, team: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "rlhf.dev/v1alpha1",
        "kind": "ClusterRLHFRuntime",
        "metadata": {"name": name},
        "spec": {
            "images": {"cpu": CPU_IMAGE, "gpu": GPU_IMAGE},
            "pods": {
                "labels": {"team": team},
                "imagePullSecrets": [{"name": "registry-creds"}],
                "fabric": {
                    "env": [{"name": "NCCL_IB_HCA", "value": "mlx5"}],
                    "annotations": {"fabric": "ib"},
                },
                "rollout": {
                    "tolerations": [{"key": "gpu-pool", "operator": "Exists", "effect": "NoSchedule"}]
                },
            },
            "jobDefaults": {"monitoring": {"stallTimeoutSeconds": 777}},
            "storage": {
                "modelCache": {"mountPath": "/models", "claimName": "models", "readOnly": True},
                "checkpoints": {"mountPath": "/checkpoints", "claimTemplate": {"size": "1Gi"}},
            },
            **spec,
        },
    }


def job_on(
    name: str, runtime_name: str, kind: str = "ClusterRLHFRuntime", **overrides: Any
) -> dict[str, Any]:
    return example_job(name, **{"spec.runtimeRef": {"kind": kind, "name": runtime_name}, **overrides})


def _one_pod_per_role(cluster: Cluster, namespace: str, job: str) -> dict[str, dict[str, Any]]:
    """One pod of each role of `job` (head, trainer, rollout), once all three exist."""
    out: dict[str, dict[str, Any]] = {}
    for pod in cluster.list("pods", namespace, selector=f"ray.io/cluster={job}"):
        out.setdefault(pod["metadata"]["labels"].get("rlhf.dev/role", "?"), pod)
    return out if {"head", "trainer", "rollout"} <= set(out) else {}


def env_names(pod: dict[str, Any]) -> set[str]:
    return {e["name"] for c in pod["spec"]["containers"] for e in c.get("env", [])}


def bound_status(cluster: Cluster, namespace: str, job: str) -> dict[str, Any] | None:
    st = ((cluster.get("rlhfjob", job, namespace) or {}).get("status")) or {}
    return st if st.get("runtime") else None


def test_pods_carry_the_runtime_and_an_edit_reaches_new_jobs_only(
    cluster: Cluster, namespace: str, op: OperatorProcess, runtime_name: str
) -> None:
    cluster.apply(runtime(runtime_name, team="a"))
    cluster.apply(job_on("first", runtime_name), namespace)
    pods = wait_for(
        lambda: _one_pod_per_role(cluster, namespace, "first"), 60, "first's head, trainer and rollout pods"
    )
    st = wait_for(lambda: bound_status(cluster, namespace, "first"), 30, "first's status.runtime")
    assert st["runtime"] == {
        "kind": "ClusterRLHFRuntime",
        "name": runtime_name,
        "generation": 1,
        "snapshot": "first-runtime",
        "checkpointClaim": "first-checkpoints",
    }, st["runtime"]
    cond = next(c for c in st["conditions"] if c["type"] == "RuntimeBound")
    assert cond["status"] == "True" and runtime_name in cond["message"], cond
    for role, pod in pods.items():
        spec = pod["spec"]
        assert pod["metadata"]["labels"]["team"] == "a", (role, pod["metadata"]["labels"])
        # The tiny job asks for GPUs, but KWOK's are advertised, not real: the operator runs with the named
        # CPU stand-in (RLHF_GPU_STANDIN=cpu), so every role gets the runtime's CPU image.
        assert {c["image"] for c in spec["containers"]} == {CPU_IMAGE}, role
        assert spec["imagePullSecrets"] == [{"name": "registry-creds"}], role
        claims = {
            v["name"]: v["persistentVolumeClaim"] for v in spec["volumes"] if "persistentVolumeClaim" in v
        }
        assert claims["model-cache"] == {"claimName": "models", "readOnly": True}, role
        assert claims["checkpoints"] == {"claimName": "first-checkpoints"}, role
        mounts = {m["name"]: m["mountPath"] for c in spec["containers"] for m in c.get("volumeMounts", [])}
        assert mounts["model-cache"] == "/models" and mounts["checkpoints"] == "/checkpoints", role
        # The fabric profile goes to the pods that join NCCL, never to the head.
        fabric = role in ("trainer", "rollout")
        assert ("NCCL_IB_HCA" in env_names(pod)) == fabric, role
        assert (pod["metadata"].get("annotations", {}).get("fabric") == "ib") == fabric, role
        tolerated = any(t.get("key") == "gpu-pool" for t in spec.get("tolerations", []))
        assert tolerated == (role == "rollout"), role
    # The job's checkpoints go under the runtime's volume, in a directory of its own; its other fields
    # are the runtime's defaults where it set none. Both reach the trainer through the driver's spec.
    rc = cluster.get("raycluster", "first", namespace)
    assert rc is not None
    claim = wait_for(
        lambda: cluster.get("pvc", "first-checkpoints", namespace), 30, "first's checkpoint claim"
    )
    assert claim["spec"]["resources"]["requests"]["storage"] == "1Gi"
    owners = claim["metadata"].get("ownerReferences", [])
    assert [(o["kind"], o["name"]) for o in owners] == [("RLHFJob", "first")], owners
    snapshot = cluster.get("configmap", "first-runtime", namespace)
    assert snapshot is not None and snapshot.get("immutable") is True
    assert '"stallTimeoutSeconds": 777' in snapshot["data"]["runtime.json"]

    # The platform team edits the runtime: the running job's pods and template stay as they were.
    before = {role: (p["metadata"]["uid"], p["metadata"]["labels"]["team"]) for role, p in pods.items()}
    template_before = rc["spec"]["headGroupSpec"]["template"]
    cluster.apply(runtime(runtime_name, team="b"))
    edited = cluster.get("clusterrlhfruntime", runtime_name)
    assert edited is not None and edited["metadata"]["generation"] == 2
    cluster.apply(job_on("second", runtime_name), namespace)
    second = wait_for(lambda: _one_pod_per_role(cluster, namespace, "second"), 60, "second's pods")
    assert {p["metadata"]["labels"]["team"] for p in second.values()} == {"b"}
    st2 = wait_for(lambda: bound_status(cluster, namespace, "second"), 30, "second's status.runtime")
    assert st2["runtime"]["generation"] == 2
    time.sleep(3)  # several reconcile rounds (1 s each) of the first job after the edit
    after = _one_pod_per_role(cluster, namespace, "first")
    assert {
        role: (p["metadata"]["uid"], p["metadata"]["labels"]["team"]) for role, p in after.items()
    } == before
    rc_after = cluster.get("raycluster", "first", namespace)
    assert rc_after is not None and rc_after["spec"]["headGroupSpec"]["template"] == template_before
    assert (bound_status(cluster, namespace, "first") or {})["runtime"]["generation"] == 1

    # A restarted operator reads the first job's snapshot back, not the edited runtime.
    op.stop()
    op.start()
    time.sleep(3)
    rc_restarted = cluster.get("raycluster", "first", namespace)
    assert rc_restarted is not None and rc_restarted["spec"]["headGroupSpec"]["template"] == template_before
    assert (bound_status(cluster, namespace, "first") or {})["runtime"]["generation"] == 1

    # whenJobDeleted: Delete (the default): the claim goes with its job.
    cluster.kubectl("delete", "rlhfjob", "first", "-n", namespace, "--wait=false")
    wait_for(
        lambda: cluster.get("pvc", "first-checkpoints", namespace) is None or None,
        90,
        "first's claim deleted",
    )


def test_retained_claim_outlives_its_job(
    cluster: Cluster, namespace: str, op: OperatorProcess, runtime_name: str
) -> None:
    retain = {
        "storage": {
            "checkpoints": {
                "mountPath": "/ckpt",
                "claimTemplate": {"size": "2Gi", "whenJobDeleted": "Retain"},
            }
        }
    }
    cluster.apply(runtime(runtime_name, team="a", **retain))
    cluster.apply(job_on("kept", runtime_name), namespace)
    claim = wait_for(lambda: cluster.get("pvc", "kept-checkpoints", namespace), 60, "kept's checkpoint claim")
    assert not claim["metadata"].get("ownerReferences"), claim["metadata"]
    assert claim["metadata"]["labels"]["rlhf.dev/when-job-deleted"] == "Retain"
    wait_for(lambda: cluster.get("raycluster", "kept", namespace), 60, "kept's RayCluster")
    cluster.kubectl("delete", "rlhfjob", "kept", "-n", namespace, "--wait=true", "--timeout=60s")
    wait_for(
        lambda: cluster.get("raycluster", "kept", namespace) is None or None, 60, "kept's RayCluster gone"
    )
    time.sleep(2)  # the garbage collector has acted on the job's dependents
    claim = cluster.get("pvc", "kept-checkpoints", namespace)
    assert claim is not None and not claim["metadata"].get("deletionTimestamp"), claim


def failed_on_runtime(cluster: Cluster, namespace: str, job: str) -> dict[str, Any]:
    st = wait_for(lambda: phase_is(cluster, namespace, job, "Failed"), 30, f"{job} Failed")
    assert cluster.get("raycluster", job, namespace) is None, "no RayCluster for a job that cannot run"
    return next(c for c in st["conditions"] if c["type"] == "RuntimeBound")


def test_a_missing_runtime_or_a_field_the_runtime_keeps_fails_the_job_at_once(
    cluster: Cluster, namespace: str, op: OperatorProcess
) -> None:
    cluster.apply(job_on("orphan", "no-such-runtime"), namespace)
    cond = failed_on_runtime(cluster, namespace, "orphan")
    assert cond["status"] == "False" and cond["reason"] == "RuntimeNotFound", cond
    assert "ClusterRLHFRuntime/no-such-runtime does not exist" in cond["message"], cond
    # A job's runtime is fixed when it is created (the API server's transition rule): naming another, or
    # none, is refused; a new job is the way.
    for patch in ('{"spec":{"runtimeRef":{"name":"other"}}}', '{"spec":{"runtimeRef":null}}'):
        proc = cluster.kubectl(
            "patch", "rlhfjob", "orphan", "-n", namespace, "--type=merge", "-p", patch, check=False
        )
        assert proc.returncode != 0 and "runtimeRef cannot be added, removed or changed" in proc.stderr, (
            proc.stderr
        )

    # A namespaced runtime keeps `security` (the default overridable): a job turning its NetworkPolicy off
    # fails at once, naming the field. (A field with a CRD default: only the operator can tell it was set,
    # so admission lets it through; test_admission_refuses_... covers what admission decides.)
    cluster.apply({**runtime("team", team="a"), "kind": "RLHFRuntime"}, namespace)
    cluster.apply(
        job_on("open", "team", kind="RLHFRuntime", **{"spec.security.networkPolicy": "Disabled"}), namespace
    )
    cond = failed_on_runtime(cluster, namespace, "open")
    assert cond["reason"] == "FieldNotOverridable", cond
    assert cond["message"].startswith(
        "spec.security.networkPolicy: RLHFRuntime/team does not let jobs set"
    ), cond
    st = (cluster.get("rlhfjob", "open", namespace) or {}).get("status", {})
    assert "spec.security.networkPolicy" in st.get("message", ""), st

    # The same job without the field runs on it.
    cluster.apply(job_on("closed", "team", kind="RLHFRuntime"), namespace)
    wait_for(lambda: cluster.get("raycluster", "closed", namespace), 60, "closed's RayCluster")


@pytest.fixture
def admission_policies(cluster: Cluster, rlhf_crd: str) -> Iterator[list[str]]:
    """The chart's two ValidatingAdmissionPolicies and bindings (rlhf_api.admission, the generator of the
    chart's template), under names of this test's own; deleted afterwards."""
    prefix = f"test-{uuid.uuid4().hex[:6]}"
    docs = [
        d for k in (CLUSTER_KIND, NAMESPACED_KIND) for d in admission.policy(k, crd.spec_schema(), prefix)
    ]
    names = []
    for doc in docs:
        cluster.apply(doc)
        names.append(f"{doc['kind'].lower()}/{doc['metadata']['name']}")
    yield names
    for name in reversed(names):
        cluster.kubectl("delete", name, "--wait=false", check=False)


def test_admission_refuses_a_job_setting_a_pod_field_its_runtime_keeps(
    cluster: Cluster, namespace: str, admission_policies: list[str], runtime_name: str
) -> None:
    cluster.apply(runtime(runtime_name, team="a"))
    # Each policy type-checks against the CRDs' schemas with no warning: every expression is sound.
    for name in admission_policies:
        if name.startswith("validatingadmissionpolicy/"):
            checked = wait_for(
                lambda name=name: (
                    ((cluster.get(*name.split("/")) or {}).get("status") or {}).get("typeChecking")
                    is not None
                    and (cluster.get(*name.split("/")) or {})["status"]
                ),
                30,
                f"{name} type-checked",
            )
            assert not checked["typeChecking"].get("expressionWarnings"), checked
    pinned = job_on("pinned", runtime_name, **{"spec.pods.nodeSelector": {"pool": "mine"}})

    def refused() -> str | None:
        proc = cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(pinned), check=False)
        if proc.returncode == 0:  # the policy not in force yet: try again
            cluster.kubectl("delete", "rlhfjob", "pinned", "-n", namespace, "--wait=false", check=False)
            return None
        return proc.stderr

    message = wait_for(refused, 30, "the job refused at admission")
    assert (
        f"spec.pods.nodeSelector: ClusterRLHFRuntime/{runtime_name} does not let jobs set this field"
        in message
    )
    # The same job without it is admitted; a runtime that lets jobs choose nodes admits it with it.
    cluster.apply(job_on("free", runtime_name), namespace)
    allowing = [*DEFAULT_OVERRIDABLE, "pods.nodeSelector"]
    cluster.apply({**runtime("team", team="a", overridable=allowing), "kind": "RLHFRuntime"}, namespace)
    cluster.apply(
        job_on("chosen", "team", kind="RLHFRuntime", **{"spec.pods.nodeSelector": {"a": "b"}}), namespace
    )
    # ...and a namespaced runtime keeping the field refuses it the same way.
    cluster.apply({**runtime("strict", team="a"), "kind": "RLHFRuntime"}, namespace)
    strict = job_on("pinned2", "strict", kind="RLHFRuntime", **{"spec.pods.nodeSelector": {"a": "b"}})
    proc = cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(strict), check=False)
    assert proc.returncode != 0 and "spec.pods.nodeSelector: RLHFRuntime/strict" in proc.stderr, proc.stderr


@pytest.mark.parametrize(
    ("storage", "field", "words"),
    [
        (
            {"checkpoints": {"mountPath": "/c", "claimName": "x", "claimTemplate": {"size": "1Gi"}}},
            "spec.storage.checkpoints.claimName",
            "set exactly one of claimName",
        ),
        (
            {"modelCache": {"mountPath": "/m", "claimTemplate": {"size": "1Gi"}}},
            "spec.storage.modelCache.claimName",
            "the model cache is an existing claim",
        ),
    ],
)
def test_the_api_server_refuses_a_bad_runtime_with_the_rule_python_checks(
    cluster: Cluster, rlhf_crd: str, runtime_name: str, storage: dict[str, Any], field: str, words: str
) -> None:
    bad = runtime(runtime_name, team="a", storage=storage)
    proc = cluster.kubectl("apply", "-f", "-", input=json.dumps(bad), check=False)
    assert proc.returncode != 0, proc.stdout
    assert field in proc.stderr and words in proc.stderr, proc.stderr
    broken = runtime_violations(RLHFRuntimeSpec.model_validate(bad["spec"]))
    assert [f"spec.{r.field}" for r in broken] == [field]
    assert words in broken[0].message
