"""Shared fixtures: the local control plane (real etcd, kube-apiserver, KubeRay, KWOK), namespaces, the
local Ray head and the operator process.

A cluster test reuses a running control plane (`make cluster-up`) or starts one for the session.
A missing prerequisite (Go, a failed build, a busy port) fails the test with the reason; nothing skips.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from testkit import collected, stages
from testkit import ray_head as ray_head_kit
from testkit.support import (
    CRD_FILE,
    RAY_DASHBOARD_PORT,
    RAY_PORT,
    Cluster,
    OperatorProcess,
    RayHead,
    _dashboard_up,
    stop_ray_start,
    wait_for,
)

import devcluster

if TYPE_CHECKING:
    from testkit.mlflow_server import MlflowServer
    from testkit.object_store import ObjectStore


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Before any -m deselection: a collected test that no stage of `make test` selects fails the run;
    the whole tree's test files are kept for the layout test (testkit.collected)."""
    stages.check_collection(items)
    collected.remember(config, items)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """In CI a skipped test is a failure: it would otherwise be counted as passing silently."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter is not None else []
    if os.environ.get("CI") and skipped and session.exitstatus == 0:
        names = ", ".join(r.nodeid for r in skipped[:10])
        print(f"\nerror: {len(skipped)} test(s) skipped in CI (a skip is a failure here): {names}")
        session.exitstatus = 1


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The offline tiny model, tokenizer and prompt set (`rlhf make-tiny-model`), made once."""
    from rlhf_trainer.tiny_model import make_tiny_model

    out = tmp_path_factory.mktemp("tiny")
    make_tiny_model(out)
    return out


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    started = False
    try:
        st = devcluster.running_status()
        if not (st and all(st.values())):
            devcluster.up()
            started = True
    except devcluster.ClusterError as e:
        pytest.fail(f"the local control plane is not available: {e}", pytrace=False)
    yield Cluster(kubeconfig=devcluster.STATE / "kubeconfig", bin_dir=devcluster.STATE / "bin")
    if started and os.environ.get("KEEP_CLUSTER") != "1":
        devcluster.down(quiet=True)


@pytest.fixture(scope="session")
def kueue(cluster: Cluster) -> Iterator[Cluster]:
    """A real Kueue in the control plane (`devcluster.py kueue-up`): its CRDs, its controller manager and
    its webhooks, for RayClusters, RayJobs and Jobs labelled kueue.x-k8s.io/queue-name. Stopped at the end
    (its webhooks removed, its CRDs left) if this session started it. Not built here: a missing build
    fails with the command that builds it."""
    try:
        started = devcluster.kueue_up()
    except devcluster.ClusterError as e:
        pytest.fail(f"Kueue is not available: {e}", pytrace=False)
    yield cluster
    if started:
        devcluster.kueue_down(quiet=True)


@pytest.fixture
def namespace(cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace per test, deleted afterwards (without waiting for finalization)."""
    base = request.node.name.lower().replace("_", "-")
    name = "".join(c for c in base if c.isalnum() or c == "-")[:40].strip("-") + "-" + uuid.uuid4().hex[:5]
    cluster.kubectl("create", "namespace", name)
    wait_for(
        lambda: cluster.get("serviceaccount", "default", name), 30, f"the default ServiceAccount in {name}"
    )
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


# --------------------------------------------------------------------------------- the io stage's servers


@pytest.fixture(scope="session")
def object_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ObjectStore]:
    """A real S3 server (moto's server mode) for the session, on every address: pods reach it at
    `pod_endpoint` through the dev cluster's gateway, tests here at `endpoint` (testkit.object_store)."""
    from testkit.object_store import running_object_store

    with running_object_store(tmp_path_factory.mktemp("s3"), for_pods=True) as store:
        yield store


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    """A real MLflow tracking server (sqlite backend, served artifacts) for the session, reachable from
    pods at `pod_url` (testkit.mlflow_server)."""
    from testkit.mlflow_server import running_mlflow_server

    with running_mlflow_server(tmp_path_factory.mktemp("mlflow"), for_pods=True) as server:
        yield server


# ----------------------------------------------------------------------------------------- Ray and operator


@pytest.fixture(scope="session")
def ray_head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayHead]:
    """A local Ray head (the stand-in for every RayCluster's head, testkit.ray_head), in its own process
    group: one already up on its dashboard port (`make test` starts one for all its stages) is used and
    left running, with every Ray job this session started and left running stopped at its end (as
    stopping the head would); else one is started for the session and stopped at its end."""
    proc: subprocess.Popen[bytes] | None = None
    before: set[str] = set()
    if _dashboard_up():
        before = set(ray_head_kit.jobs())
    else:
        try:
            proc = ray_head_kit.start(tmp_path_factory.mktemp("ray") / "ray-head.log")
        except RuntimeError as e:
            pytest.fail(str(e), pytrace=False)
    yield RayHead(address=f"127.0.0.1:{RAY_PORT}", dashboard_url=f"http://127.0.0.1:{RAY_DASHBOARD_PORT}")
    if proc is not None:
        stop_ray_start(proc)
    else:
        left = ray_head_kit.stop_jobs(keep=before)
        if left:
            print(f"[ray-head] stopped {len(left)} Ray job(s) this session left running: {left}")


@pytest.fixture(scope="session")
def rlhf_crd(cluster: Cluster) -> str:
    """Server-side applies the committed CRDs (what users get: RLHFJob and the two runtimes), waits for
    each to be Established, returns the RLHFJob CRD's name."""
    names = []
    for path in sorted(CRD_FILE.parent.glob("*.yaml")):
        cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(path))
        names.append(path.stem)
    for name in names:
        # Not `kubectl wait`: it fails at once, instead of waiting, while a new CRD has no conditions yet.
        wait_for(
            lambda name=name: (
                "True"
                in cluster.kubectl(
                    "get",
                    f"crd/{name}",
                    "-o",
                    "jsonpath={.status.conditions[?(@.type=='Established')].status}",
                    check=False,  # kubectl's jsonpath filter errors while there are no conditions at all
                ).stdout
                or None
            ),
            60,
            f"the CRD {name} Established",
        )
    return "rlhfjobs.rlhf.dev"


@pytest.fixture
def operator(cluster: Cluster, rlhf_crd: str, ray_head: RayHead, tmp_path: Path) -> Iterator[OperatorProcess]:
    op = OperatorProcess(cluster, tmp_path / "operator.log")
    op.start()
    yield op
    op.stop()
    print(f"--- operator log tail ---\n{op.log_tail()}")
