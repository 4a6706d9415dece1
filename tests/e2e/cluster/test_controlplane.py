"""The local control plane is real: versioned API server, KubeRay reconciling, KWOK running pods, GC."""

from __future__ import annotations

import json
from typing import Any

import pytest
from testkit.support import Cluster, wait_for

pytestmark = pytest.mark.cluster


def raycluster(name: str, gpu_workers: int = 2) -> dict[str, Any]:
    def container(role: str, gpus: int) -> dict[str, Any]:
        res: dict[str, Any] = {"cpu": "1", "memory": "2Gi"}
        if gpus:
            res["nvidia.com/gpu"] = str(gpus)
        return {
            "name": f"ray-{role}",
            "image": "rayproject/ray:2.60.0",
            "resources": {"requests": res, "limits": res},
        }

    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayCluster",
        "metadata": {"name": name},
        "spec": {
            "rayVersion": "2.60.0",
            "headGroupSpec": {
                "rayStartParams": {},
                "template": {"spec": {"containers": [container("head", 0)]}},
            },
            "workerGroupSpecs": [
                {
                    "groupName": "gpu",
                    "replicas": gpu_workers,
                    "minReplicas": 0,
                    "maxReplicas": 4,
                    "rayStartParams": {},
                    "template": {"spec": {"containers": [container("worker", 4)]}},
                }
            ],
        },
    }


def test_server_reports_a_real_version(cluster: Cluster) -> None:
    out = json.loads(cluster.kubectl("version", "-o", "json").stdout)
    server = out["serverVersion"]["gitVersion"]
    assert server.startswith("v1.3"), server
    assert server != "v0.0.0"


def test_kuberay_crds_and_gpu_nodes_are_installed(cluster: Cluster) -> None:
    crd = cluster.get("crd", "rayclusters.ray.io")
    assert crd is not None
    nodes = cluster.list("nodes", selector="type=kwok")
    assert len(nodes) >= 2
    for node in nodes:
        assert node["status"]["allocatable"]["nvidia.com/gpu"] == "8"
        ready = {c["type"]: c["status"] for c in node["status"]["conditions"]}
        assert ready.get("Ready") == "True", node["metadata"]["name"]


def test_raycluster_becomes_ready_on_kwok_nodes_and_is_garbage_collected(
    cluster: Cluster, namespace: str
) -> None:
    cluster.apply(raycluster("rc"), namespace)

    def pods() -> list[dict[str, Any]]:
        return cluster.list("pods", namespace, selector="ray.io/cluster=rc")

    running = wait_for(
        lambda: (p := pods()) and len(p) == 3 and all(x["status"].get("phase") == "Running" for x in p) and p,
        90,
        "head + 2 GPU workers Running",
    )
    assert all(p["spec"]["nodeName"].startswith("kwok-gpu-") for p in running)
    workers = [p for p in running if p["metadata"]["labels"]["ray.io/node-type"] == "worker"]
    assert len(workers) == 2
    assert all(p["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "4" for p in workers)

    def state() -> str | None:
        rc = cluster.get("raycluster", "rc", namespace) or {}
        return "ready" if rc.get("status", {}).get("state") == "ready" else None

    assert wait_for(state, 90, "RayCluster .status.state == ready") == "ready"

    cluster.kubectl("delete", "raycluster", "rc", "-n", namespace, "--wait=true")
    wait_for(lambda: not pods() and "gone", 60, "the RayCluster's pods to be garbage-collected")


def test_api_server_rejects_an_object_that_violates_the_crd_schema(cluster: Cluster, namespace: str) -> None:
    bad = raycluster("bad")
    bad["spec"]["workerGroupSpecs"][0]["replicas"] = "two"
    proc = cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(bad), check=False)
    assert proc.returncode != 0
    assert "replicas" in proc.stderr, proc.stderr
    assert cluster.get("raycluster", "bad", namespace) is None


def test_scheduler_leaves_pods_pending_when_no_node_has_the_gpus(cluster: Cluster, namespace: str) -> None:
    greedy = raycluster("greedy", gpu_workers=1)
    greedy["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["resources"] = {
        "requests": {"nvidia.com/gpu": "16"},
        "limits": {"nvidia.com/gpu": "16"},
    }
    cluster.apply(greedy, namespace)

    def unschedulable() -> str | None:
        for p in cluster.list("pods", namespace, selector="ray.io/cluster=greedy,ray.io/node-type=worker"):
            for c in p["status"].get("conditions", []):
                if c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable":
                    return str(c.get("message"))
        return None

    msg = wait_for(unschedulable, 60, "the 16-GPU worker to be Unschedulable")
    assert "nvidia.com/gpu" in msg
