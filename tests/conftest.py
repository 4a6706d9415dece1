"""Shared fixtures: the local control plane (real etcd, kube-apiserver, KubeRay, KWOK), namespaces, the
local Ray head and the operator process.

A cluster test reuses a running control plane (`make cluster-up`) or starts one for the session.
A missing prerequisite (Go, a failed build, a busy port) fails the test with the reason; nothing skips.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import (
    CRD_FILE,
    RAY_DASHBOARD_PORT,
    RAY_PORT,
    ROOT,
    VENV_BIN,
    Cluster,
    OperatorProcess,
    RayHead,
    _dashboard_up,
    wait_for,
)

sys.path.insert(0, str(ROOT / "tests" / "controlplane"))

import devcluster


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


# ----------------------------------------------------------------------------------------- Ray and operator


@pytest.fixture(scope="session")
def ray_head() -> Iterator[RayHead]:
    env = {**os.environ, "PATH": f"{VENV_BIN}:{os.environ['PATH']}", "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    started = False
    if not _dashboard_up():
        proc = subprocess.run(
            [
                str(VENV_BIN / "ray"),
                "start",
                "--head",
                f"--port={RAY_PORT}",
                "--dashboard-host=127.0.0.1",
                f"--dashboard-port={RAY_DASHBOARD_PORT}",
                "--num-cpus=4",
                "--include-dashboard=true",
                "--disable-usage-stats",
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
        )
        if proc.returncode != 0:
            pytest.fail(f"could not start the local Ray head:\n{proc.stdout}\n{proc.stderr}", pytrace=False)
        started = True
        wait_for(lambda: _dashboard_up() or None, 60, "the Ray dashboard")
    yield RayHead(address=f"127.0.0.1:{RAY_PORT}", dashboard_url=f"http://127.0.0.1:{RAY_DASHBOARD_PORT}")
    if started:
        subprocess.run([str(VENV_BIN / "ray"), "stop", "--force"], env=env, capture_output=True, timeout=120)


@pytest.fixture(scope="session")
def rlhf_crd(cluster: Cluster) -> str:
    """Server-side applies the committed RLHFJob CRD (what users get), waits for Established, returns its name."""
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD_FILE))
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd/rlhfjobs.rlhf.dev")
    return "rlhfjobs.rlhf.dev"


@pytest.fixture
def operator(cluster: Cluster, rlhf_crd: str, ray_head: RayHead, tmp_path: Path) -> Iterator[OperatorProcess]:
    op = OperatorProcess(cluster, tmp_path / "operator.log")
    op.start()
    yield op
    op.stop()
    print(f"--- operator log tail ---\n{op.log_tail()}")
