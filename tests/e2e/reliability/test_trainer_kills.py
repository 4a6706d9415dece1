"""Fault injection on the real stack: trainer Ray actors SIGKILLed mid-step, and mid-checkpoint.

One RLHFJob on the local control plane and the local Ray head meets one fault per attempt, each in a
different phase: the (only) rollout engine dies in generation, the driver mid-checkpoint, an actor rank
in actor training (rlhf_trainer.faults: a real SIGKILL of the process when the phase starts), and the
rollout engine in the middle of a weight sync (once the actor ranks have begun sending). The operator
must restart the job within backoffLimit each time; every attempt resumes from the newest complete
checkpoint; the job completes all its steps. One job rather than one per fault: each trainer start
costs about a minute on 2 cores. The reward and weight_sync (actor rank) kills ran here too until the
suite outgrew its time budget; they stay armable (RLHF_TRAINER_FAULTS=reward@N,weight_sync@N).
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pytest
from testkit.support import Cluster, OperatorProcess, ray_job_logs, step_reports, tiny_job, wait_for

pytestmark = pytest.mark.reliability

# step -> the phase whose start kills an actor; the checkpoint kill lands after weight sync of step 3;
# engine_weight_sync kills the rollout engine once the actor ranks have begun sending step 5's weights
FAULTS = {2: "generation", 3: "checkpoint", 4: "actor_train", 5: "engine_weight_sync"}
STEPS = 5


def attempt_steps(logs: str) -> tuple[int | None, list[int]]:
    """(the step this attempt resumed from, the steps it completed) from the driver's log lines."""
    resumed = re.search(r"resumed from \S+ \(step (\d+)\)", logs)
    done = [r["step"] for r in step_reports(logs)]
    return (int(resumed.group(1)) if resumed else None), done


def test_actor_killed_in_each_phase_restarts_from_the_last_checkpoint_and_completes(
    cluster: Cluster, namespace: str, operator: OperatorProcess, tiny_model: Path, tmp_path: Path
) -> None:
    ckpt, marks = tmp_path / "ckpt", tmp_path / "faults"
    doc = tiny_job(
        "faulty", tiny_model, ckpt, steps=STEPS, lean=True, runPolicy={"backoffLimit": len(FAULTS)}
    )
    doc["spec"]["checkpoint"].update(intervalSteps=1, keepLast=3)
    armed = ",".join(f"{phase}@{step}" for step, phase in FAULTS.items())
    doc["spec"].setdefault("pods", {})["env"] = [
        {"name": "RLHF_TRAINER_FAULTS", "value": armed},
        {"name": "RLHF_TRAINER_FAULTS_DIR", "value": str(marks)},
    ]
    t0 = time.monotonic()
    cluster.apply(doc, namespace)

    seen: list[int] = []  # status.step at every poll, to check a restart never shows 0 again
    running: list[int] = []  # status.step at the polls that saw the job Running (the scraped value)

    def finished() -> dict[str, Any] | None:
        st = (cluster.get("rlhfjob", "faulty", namespace) or {}).get("status", {})
        if st.get("step") is not None:
            seen.append(int(st["step"]))
            if st.get("phase") == "Running":
                running.append(int(st["step"]))
        return st if st.get("phase") in ("Succeeded", "Failed") else None

    st = wait_for(finished, 1500, "the faulted job to finish")
    elapsed = time.monotonic() - t0
    fired = sorted(p.name for p in marks.iterdir())
    assert st["phase"] == "Succeeded", (st, fired)
    assert fired == sorted(f"{phase}@{step}" for step, phase in FAULTS.items()), fired
    assert st["restarts"] == len(FAULTS)

    # Each attempt's story from its own Ray job log: where it resumed, which steps it completed.
    uid = st["submissionId"].rsplit("-", 1)[0]  # rlhf-<ns>-<job>-<uid8>
    rows, logs = [], []
    for attempt in range(len(FAULTS) + 1):
        logs.append(ray_job_logs(f"{uid}-{attempt}"))
        resumed, done = attempt_steps(logs[-1])
        rows.append((attempt, resumed, done))
    print("\nattempt  resumed-from  completed-steps")
    for attempt, resumed, done in rows:
        print(f"{attempt:>7}  {resumed!s:>12}  {done}")
    print(f"faults: {len(FAULTS)}; wall time to Succeeded {elapsed:.0f}s")

    # A restarted attempt announces the step it resumes from before its minute of start-up.
    after_first = seen[next((i for i, v in enumerate(seen) if v > 0), len(seen)) :]
    assert 0 not in after_first, f"status.step fell back to 0 during a restart: {seen}"

    # The last step is the driver's own report (on success the operator writes totalSteps into status.step
    # itself, so that value proves nothing); while Running, status.step (scraped from the trainer's
    # /metrics) was only ever 0 or a step some attempt's driver reported, and moved past 0.
    completed = [s for _, _, done in rows for s in done]
    assert rows[-1][2][-1] == STEPS, rows
    assert max(running, default=0) >= 1 and set(running) <= {0, *completed}, (sorted(set(running)), rows)
    # One engine (the tiny job's): losing it in generation leaves none, so the step fails with the
    # driver's own message and the attempt is restarted (attempt 1 resumes from step 1's checkpoint).
    assert "step 2: every rollout engine was lost" in logs[0], logs[0][-3000:]
    assert "chunk(s) generated again" not in logs[0]
    # The engine killed mid-broadcast (attempt 3, step 5): the sync cannot go on without it, so the attempt
    # fails with the driver's error line and the next one resumes from step 4's checkpoint.
    assert "mid weight sync of step 5" in logs[3], logs[3][-3000:]
    errors = [line for line in logs[3].splitlines() if line.startswith("error: ")]
    assert errors, logs[3][-3000:]
    print(f"attempt 3 (engine killed mid weight sync): {errors[-1][:300]}")
    assert sorted(set(completed)) == list(range(1, STEPS + 1)), rows  # every step done, none skipped
    assert rows[0][1] is None  # the first attempt starts fresh
    for attempt, resumed, _ in rows[1:]:
        last_done = max((s for _, _, done in rows[:attempt] for s in done), default=0)
        # Checkpoints every step: an attempt resumes from the last step completed before the fault, so
        # only the interrupted step is redone. The checkpoint kill (step 3) leaves a half-written
        # step-3 checkpoint that must never be picked: the resume is then from step 2.
        assert resumed == last_done, rows
    # The driver died with every shard of step 3's checkpoint written but not committed: that directory
    # was there at the kill, and the resume removed it instead of using it.
    at_kill = json.loads((marks / "checkpoint@3").read_text())
    assert any(p.startswith(".tmp-step-00000003") for p in at_kill["partial_checkpoints"]), at_kill
    assert not list(ckpt.glob(".tmp-*")), sorted(p.name for p in ckpt.iterdir())
    assert (ckpt / "step-00000005" / "trainer_state.json").exists()

    # One Restarting Event per restart (the API server folds repeats into one Event's count).
    restarting = [
        e.get("count") or 1
        for e in cluster.list("events", namespace)
        if e.get("involvedObject", {}).get("name") == "faulty" and e["reason"] == "Restarting"
    ]
    assert sum(restarting) == st["restarts"], restarting
