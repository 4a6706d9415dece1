"""The real node's test helpers: the release's and the data volume's names, the job and runtime the tests
submit, and waits on the job's pods (tests/e2e/realnode's fixtures and tests use them)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import node
from rlhf_operator.manifests import JOB_LABEL

from testkit.support import Cluster, wait_for

RELEASE, OPERATOR_NAMESPACE = "rlhf-operator", "rlhf-system"


DATA_UID = 10001  # the trainer image's user; the PersistentVolume's files belong to it


STORAGE_CLASS = "rlhf-local"


@dataclass(frozen=True)
class Images:
    operator: str
    trainer: str


def on_real_node() -> dict[str, Any]:
    """Pod settings that put a pod on the real node (its label, its taint)."""
    return {
        "nodeSelector": {node.NODE_LABEL[0]: node.NODE_LABEL[1]},
        "tolerations": [{"key": node.NODE_TAINT, "operator": "Exists", "effect": "NoSchedule"}],
    }


RUNTIME = "cpu-dev"


DATA_CLAIM, CHECKPOINTS = "tiny-data", "/checkpoints"


def runtime_spec() -> dict[str, Any]:
    """The cpu-dev ClusterRLHFRuntime's spec over the chart's (docs/runtimes.md)."""
    return {
        "pods": on_real_node(),
        "storage": {
            "modelCache": {"mountPath": "/data", "claimName": DATA_CLAIM},
            "checkpoints": {
                "mountPath": CHECKPOINTS,
                "claimTemplate": {
                    "size": "1Gi",
                    "storageClassName": STORAGE_CLASS,
                    "accessModes": ["ReadWriteOnce"],
                    "whenJobDeleted": "Delete",
                },
            },
        },
    }


def local_volume(name: str, path: Path, namespace: str, claim: str) -> dict[str, Any]:
    """A local PersistentVolume on the real node at `path`, kept for the claim `namespace/claim`."""
    host = {"key": "kubernetes.io/hostname", "operator": "In", "values": [node.NODE_NAME]}
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": name},
        "spec": {
            "capacity": {"storage": "2Gi"},
            "accessModes": ["ReadWriteOnce"],
            "persistentVolumeReclaimPolicy": "Retain",
            "storageClassName": STORAGE_CLASS,
            "local": {"path": str(path)},
            "claimRef": {"namespace": namespace, "name": claim},
            "nodeAffinity": {"required": {"nodeSelectorTerms": [{"matchExpressions": [host]}]}},
        },
    }


def realnode_job(name: str, claim: str, steps: int, interval: int, **spec: Any) -> dict[str, Any]:
    """examples/rlhfjob-tiny.yaml as a real job on the chart's cpu-dev runtime: the experiment only. The
    runtime gives the image, the node's selector and toleration, the data claim (`claim`) at /data and a
    checkpoint claim of the job's own (checkpoints under /checkpoints/<namespace>/<job>)."""
    from testkit.support import tiny_job

    assert claim == DATA_CLAIM, claim
    doc = tiny_job(name, Path("/data"), Path("/unused"), steps)
    s = doc["spec"]
    s["runtimeRef"] = {"kind": "ClusterRLHFRuntime", "name": RUNTIME}
    s["checkpoint"].pop("path")
    s["checkpoint"].update(intervalSteps=interval, keepLast=2)
    # 600 s, not the example's 300: an attempt restarted after the head pod's loss waits for the worker
    # containers to come back into the new head, which once took over 300 s on the loaded 2-core machine
    # (the operator then stalled and restarted it once more). These runs are not about stalls
    # (tests/e2e/cluster/test_stall_diagnosis.py is).
    s["monitoring"].update(metricsPort=9400, scrapeIntervalSeconds=2, stallTimeoutSeconds=600)
    for key, value in spec.items():
        s[key] = {**s.get(key, {}), **value}
    return doc


def job_pods(cluster: Cluster, namespace: str, job: str | None = None) -> list[dict[str, Any]]:
    """The pods of `namespace`, or of its RLHFJob `job` only (the operator's job label)."""
    return cluster.list("pods", namespace, f"{JOB_LABEL}={job}" if job else None)


def wait_no_pods(cluster: Cluster, namespace: str, timeout: float, job: str | None = None) -> None:
    whose = f"job {job}" if job else namespace
    wait_for(lambda: not job_pods(cluster, namespace, job) or None, timeout, f"every pod of {whose} gone")
