"""The real node's fixtures: the images built here, the chart installed with them (the operator in its
own pod), and a local PersistentVolume holding the tiny model, prompts and checkpoints.

Nothing here uses the development override: the operator reaches each head through its Service's DNS
name, and the trainer runs in KubeRay's pods from the trainer image.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import node
import pytest
from testkit.realnode import (
    DATA_CLAIM,
    DATA_UID,
    OPERATOR_NAMESPACE,
    RELEASE,
    RUNTIME,
    STORAGE_CLASS,
    Images,
    local_volume,
    on_real_node,
    runtime_spec,
)
from testkit.realnode_io import Mlflow, mlflow
from testkit.support import ROOT, Cluster, wait_for


@pytest.fixture(scope="session")
def real_node(cluster: Cluster) -> str:
    """The kubelet's node, Ready. A control plane started without it fails here with the reason."""
    obj = cluster.get("node", node.NODE_NAME)
    if obj is None:
        pytest.fail(
            f"no node {node.NODE_NAME}: the control plane runs without the real node "
            "(RLHF_REAL_NODE=0, or `make cluster-up` could not start it: see .cluster/logs/kubelet.log)",
            pytrace=False,
        )
    ready = [c for c in obj["status"].get("conditions", []) if c["type"] == "Ready"]
    assert ready and ready[0]["status"] == "True", f"{node.NODE_NAME} is not Ready: {ready}"
    return node.NODE_NAME


@pytest.fixture(scope="session")
def images(real_node: str) -> Images:
    """`make images` (content-hashed: seconds when nothing changed), loaded into the node's containerd."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "images" / "build_images.py"), "all"],
        capture_output=True,
        text=True,
        timeout=3600,
    )
    refs = dict(re.findall(r"^(operator|trainer)-image: (\S+)$", proc.stdout, re.M))
    if proc.returncode != 0 or len(refs) != 2:
        pytest.fail(f"make images failed ({proc.returncode}):\n{proc.stderr[-3000:]}\n{proc.stdout[-2000:]}")
    return Images(refs["operator"], refs["trainer"])


@pytest.fixture(scope="module")
def operator_release(
    cluster: Cluster, images: Images, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """`helm install` of the chart with the operator image built here; the operator runs in its pod.

    Per module, and gone (its pod too) before the next module starts: it watches every namespace, so
    left running it would make the Secrets of later tests' jobs from its own key (`pytest -m security`
    failed that way in tests/e2e/security/test_job_objects.py).
    """
    op_repo, op_tag = images.operator.rsplit(":", 1)
    tr_repo, tr_tag = images.trainer.rsplit(":", 1)
    values = {
        "image": {"repository": op_repo, "tag": op_tag, "pullPolicy": "Never"},
        # The node's nvidia.com/gpu is advertised, not real: the chart's named CPU stand-in.
        "jobDefaults": {"trainerImage": {"repository": tr_repo, "tag": tr_tag}, "gpuStandIn": "cpu"},
        # The chart's CPU runtime, with what the platform team of this node would give it: the node's
        # label and taint, the data claim as the model cache, a checkpoint claim per job (RUNTIME).
        "runtimes": {"cpuDev": {"enabled": True, "name": RUNTIME, "spec": runtime_spec()}},
        "operator": {"logFormat": "json"},
        **on_real_node(),
    }
    path = tmp_path_factory.mktemp("chart") / "values.json"
    path.write_text(json.dumps(values))
    chart = str(ROOT / "charts" / "rlhf-operator")
    cluster.helm(
        "upgrade", "--install", RELEASE, chart, "-n", OPERATOR_NAMESPACE, "--create-namespace",
        "-f", str(path), "--wait", "--timeout", "300s", timeout=360,
    )  # fmt: skip
    yield RELEASE
    logs = cluster.kubectl(
        "logs", "-n", OPERATOR_NAMESPACE, f"deploy/{RELEASE}", "--tail=40", check=False
    ).stdout
    print(f"--- operator pod log tail ---\n{logs}")
    cluster.helm("uninstall", RELEASE, "-n", OPERATOR_NAMESPACE, "--wait", "--timeout", "120s", check=False)
    # `helm uninstall --wait` waits for the Deployment, not for its pod, which the garbage collector
    # deletes after it: the operator in it still acts until then.
    pods = f"app.kubernetes.io/instance={RELEASE},app.kubernetes.io/name=rlhf-operator"
    wait_for(
        lambda: not cluster.list("pods", OPERATOR_NAMESPACE, selector=pods) or None,
        120,
        "the chart's operator pod gone after uninstall",
    )


@pytest.fixture
def local_data(
    cluster: Cluster, namespace: str, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """A PVC bound to a local PersistentVolume on the real node, holding the tiny model and prompts
    (/data/model, /data/prompts.jsonl), and a second volume kept for the job's own checkpoint claim.
    Returns the data claim's name."""
    root = tmp_path_factory.mktemp("pv")
    root.chmod(0o755)
    data = root / "data"
    shutil.copytree(tiny_model, data)
    for path in [data, *data.rglob("*")]:
        shutil.chown(path, DATA_UID, DATA_UID)
    # The per-job checkpoint claim the runtime's template makes (tiny-checkpoints) binds to a second
    # volume: this machine has no provisioner, so the test stands in for one by making its volume first.
    checkpoints = root / "checkpoints"
    checkpoints.mkdir()
    shutil.chown(checkpoints, DATA_UID, DATA_UID)
    pvs = [f"rlhf-data-{uuid.uuid4().hex[:8]}", f"rlhf-ckpt-{uuid.uuid4().hex[:8]}"]
    cluster.apply(
        {
            "apiVersion": "storage.k8s.io/v1",
            "kind": "StorageClass",
            "metadata": {"name": STORAGE_CLASS},
            "provisioner": "kubernetes.io/no-provisioner",
            "volumeBindingMode": "WaitForFirstConsumer",
        }
    )
    for pv, path, claim in zip(pvs, (data, checkpoints), (DATA_CLAIM, "tiny-checkpoints"), strict=True):
        cluster.apply(local_volume(pv, path, namespace, claim))
    cluster.apply(
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": "tiny-data"},
            "spec": {
                "accessModes": ["ReadWriteOnce"],
                "storageClassName": STORAGE_CLASS,
                "resources": {"requests": {"storage": "2Gi"}},
            },
        },
        namespace,
    )
    yield DATA_CLAIM
    for pv in pvs:
        cluster.kubectl("delete", "pv", pv, "--wait=false", check=False)


@pytest.fixture(scope="module")
def tracking_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mlflow]:
    """A real MLflow server the job's pods reach through the node's gateway, that the test can stop and
    start again on the same port and store (testkit.realnode_io)."""
    with mlflow(tmp_path_factory.mktemp("mlflow")) as server:
        yield server
