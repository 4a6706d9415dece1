"""What the tracking sinks are given (rlhf_trainer.tracking.report and the sinks' pure helpers): the step
report as flat metrics, the spec as flat params, when a samples table is due, and the run's address."""

from __future__ import annotations

from dataclasses import asdict

import pytest
from rlhf_api.spec import RLHFJobSpec, TrackingSpec
from rlhf_trainer.loop import StepReport, prompt_text
from rlhf_trainer.tracking.dispatch import SampleRow
from rlhf_trainer.tracking.mlflow_sink import run_url, samples_table
from rlhf_trainer.tracking.report import PARAM_VALUE_LIMIT, config_params, samples_due, step_metrics
from rlhf_trainer.tracking.tensorboard_sink import markdown_table
from rlhf_trainer.tracking.wandb_sink import run_id

pytestmark = pytest.mark.unit

SPEC = {
    "model": {"actor": "/models/actor", "reward": {"type": "function", "function": "rewards:score"}},
    "data": {"prompts": "/data/prompts.jsonl"},
    "tracking": {"tensorboard": {"logDir": "/tb"}, "samplesEverySteps": 5},
}


def report() -> StepReport:
    return StepReport(
        step=3,
        phase_seconds={"generation": 1.5, "actor_train": 0.5},
        reward_mean=0.25,
        kl=float("nan"),
        generated_tokens=100,
        trained_tokens=90,
        reward_errors=0,
        valid_samples=8,
        tokens_per_second=66.0,
        engines=[0, 1],
        checkpoint="/ckpt/step-3",
        training={"policy_loss": -0.1},
        rollout_digest="abc",
        evaluation={"reward_mean": 0.5, "by_data_source": {"gsm8k": 0.75}},
    )


def test_step_metrics_flatten_the_report_with_phase_timings_and_drop_what_is_not_a_number() -> None:
    m = step_metrics(asdict(report()))
    assert m["phase_seconds/generation"] == 1.5 and m["phase_seconds/actor_train"] == 0.5
    assert m["reward_mean"] == 0.25 and m["generated_tokens"] == 100.0
    assert m["training/policy_loss"] == -0.1
    assert m["evaluation/by_data_source/gsm8k"] == 0.75
    assert "kl" not in m  # not finite
    assert not {"step", "rollout_digest", "checkpoint", "engines"} & set(m)
    assert all(isinstance(v, float) for v in m.values())


def test_config_params_are_the_spec_as_dotted_paths_without_the_tracking_settings() -> None:
    spec = RLHFJobSpec.model_validate(SPEC)
    p = config_params(spec, "job-a")
    assert p["rlhfjob"] == "job-a"
    assert p["model.actor"] == "/models/actor"
    assert p["algorithm.advantageEstimator"] == spec.algorithm.advantage_estimator
    assert p["algorithm.klCoef"] == str(spec.algorithm.kl_coef)
    assert not any(k.startswith("tracking") for k in p)
    assert all(isinstance(v, str) and len(v) <= PARAM_VALUE_LIMIT for v in p.values())


def test_samples_are_due_every_n_steps_and_never_without_the_setting() -> None:
    t = TrackingSpec.model_validate({"tensorboard": {"logDir": "/tb"}, "samplesEverySteps": 5})
    assert [s for s in range(1, 16) if samples_due(t, s)] == [5, 10, 15]
    assert not samples_due(TrackingSpec.model_validate({"tensorboard": {"logDir": "/tb"}}), 5)
    assert not samples_due(None, 5)


def test_the_mlflow_run_url_and_table_shape() -> None:
    assert run_url("http://mlflow:5000/", "3", "ab12") == "http://mlflow:5000/#/experiments/3/runs/ab12"
    table = samples_table(5, [SampleRow("p", "c", 1.0), SampleRow("q", "d", None)])
    assert table == {
        "columns": ["step", "prompt", "completion", "reward"],
        "data": [[5, "p", "c", 1.0], [5, "q", "d", None]],
    }


def test_markdown_table_escapes_pipes_and_newlines() -> None:
    text = markdown_table(("a", "b"), [["x|y", "1\n2"]])
    assert text.splitlines() == ["| a | b |", "|---|---|", "| x\\|y | 1<br>2 |"]


def test_wandb_run_id_is_stable_per_job_and_within_wandbs_alphabet() -> None:
    a = run_id("my.job")
    assert a == run_id("my.job") and a != run_id("my-job")
    assert a.startswith("my-job-") and len(a) <= 64 and all(c.isalnum() or c in "-_" for c in a)


def test_prompt_text_writes_chat_messages_as_role_lines() -> None:
    assert prompt_text("hi") == "hi"
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]
    assert prompt_text(chat) == "system: be brief\nuser: 2+2?"
