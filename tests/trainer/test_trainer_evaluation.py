"""The evaluation split (spec.evaluation, data.eval): its spec and rules naming the field, which steps
evaluate, the split streamed in file order, the per-data_source tally, and the step loop's wiring: the
`eval` phase is timed in the step, its figures go to the report and /metrics, and none of its samples is
counted as a training sample. The real path runs in tests/trainer
(test_reward_errors_are_counted_and_follow_on_error, with an eval split every 4 steps)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from rlhf_api.rules import violated
from rlhf_api.spec import EvaluationSpec, RLHFJobSpec
from rlhf_api.validate import validate_manifest
from rlhf_trainer import loop
from rlhf_trainer.config import InputError, eval_sampling, preflight
from rlhf_trainer.data import DatasetError, EvalPrompts
from rlhf_trainer.evaluation import EvalTally, chunk_scores, source_of
from rlhf_trainer.metrics import PHASES, TrainerExporter
from rlhf_trainer.workers.reward_results import RewardResult
from testkit.support import metric_value

pytestmark = pytest.mark.unit


def _spec(evaluation: dict[str, Any] | None = None, eval_split: bool = True, **algorithm: Any) -> RLHFJobSpec:
    data: dict[str, Any] = {"prompts": "/p.jsonl"}
    if eval_split:
        data["eval"] = {"prompts": "/e.jsonl"}
    raw: dict[str, Any] = {
        "model": {"actor": "/m", "reward": {"type": "function", "function": "r:f"}},
        "data": data,
        "algorithm": {"totalSteps": 10, **algorithm},
    }
    if evaluation is not None:
        raw["evaluation"] = evaluation
    return RLHFJobSpec.model_validate(raw)


def _manifest(spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "rlhf.dev/v1alpha1", "kind": "RLHFJob", "metadata": {"name": "e"}, "spec": spec}


# ---- the spec ------------------------------------------------------------------------------------


def test_defaults_are_greedy_one_response_at_the_end_only() -> None:
    plan = _spec().evaluation_plan()
    assert plan == EvaluationSpec() and plan.every_steps is None and plan.at_end
    assert eval_sampling(_spec()) == {
        "n": 1, "temperature": 0.0, "top_p": 1.0, "max_tokens": 1024, "max_prompt_tokens": 1024,
    }  # fmt: skip
    assert _spec(eval_split=False).evaluation_plan() is None  # no split: no evaluation at all
    s = _spec(
        {
            "everySteps": 5,
            "sampling": {"temperature": 0.7, "topP": 0.9, "maxTokens": 64, "samplesPerPrompt": 4},
        }
    )
    assert eval_sampling(s) == {
        "n": 4,
        "temperature": 0.7,
        "top_p": 0.9,
        "max_tokens": 64,
        "max_prompt_tokens": 1024,
    }


@pytest.mark.parametrize(
    ("spec", "field", "rule"),
    [
        ({"evaluation": {"everySteps": 2}}, "spec.data.eval", "evaluation-needs-eval-split"),
        ({"eval": True, "evaluation": {"atEnd": False}}, "spec.evaluation.atEnd", "evaluation-runs-sometime"),
        ({"eval": True, "evaluation": {"sampling": {"samplesPerPrompt": 2}}}, "spec.evaluation.sampling.samplesPerPrompt",
         "eval-samples-need-temperature"),
        ({"eval": True, "evaluation": {"sampling": {"maxTokens": 2048}}}, "spec.evaluation.sampling.maxTokens",
         "eval-max-tokens-within-max-response"),
    ],
)  # fmt: skip
def test_each_rule_names_its_field(spec: dict[str, Any], field: str, rule: str) -> None:
    raw: dict[str, Any] = {
        "model": {"actor": "/m", "reward": {"type": "function", "function": "r:f"}},
        "data": {
            "prompts": "/p.jsonl",
            **({"eval": {"prompts": "/e.jsonl"}} if spec.pop("eval", False) else {}),
        },
        **spec,
    }
    issues = validate_manifest(_manifest(raw))
    assert [i.path for i in issues] == [field], issues
    assert [r.name for r in violated(RLHFJobSpec.model_validate(raw))] == [rule]


@pytest.mark.parametrize(
    ("evaluation", "field"),
    [
        ({"everySteps": 0}, "spec.evaluation.everySteps"),
        ({"sampling": {"temperature": -0.5}}, "spec.evaluation.sampling.temperature"),
        ({"sampling": {"samplesPerPrompt": 0}}, "spec.evaluation.sampling.samplesPerPrompt"),
        ({"every": 3}, "spec.evaluation.every"),
    ],
)
def test_a_bad_value_names_its_field(evaluation: dict[str, Any], field: str) -> None:
    raw = {
        "model": {"actor": "/m", "reward": {"type": "function", "function": "r:f"}},
        "data": {"prompts": "/p.jsonl", "eval": {"prompts": "/e.jsonl", "maxPrompts": 8}},
        "evaluation": evaluation,
    }
    assert [i.path for i in validate_manifest(_manifest(raw))] == [field]


# ---- which steps evaluate ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("evaluation", "steps"),
    [
        ({"everySteps": 4}, [4, 8, 10]),  # and at the end
        ({"everySteps": 5}, [5, 10]),  # the end is one of them: once
        ({"everySteps": 4, "atEnd": False}, [4, 8]),
        ({}, [10]),
        (None, [10]),  # data.eval alone: the defaults
        ({"everySteps": 1}, list(range(1, 11))),
        ({"everySteps": 20}, [10]),
    ],
)
def test_steps_that_evaluate(evaluation: dict[str, Any] | None, steps: list[int]) -> None:
    spec = _spec(evaluation)
    ctx = SimpleNamespace(spec=spec, data=SimpleNamespace(eval_split=object()))
    assert [s for s in range(1, 11) if loop.eval_due(ctx, s)] == steps  # type: ignore[arg-type]


def test_no_step_evaluates_without_a_split() -> None:
    ctx = SimpleNamespace(spec=_spec(eval_split=False), data=SimpleNamespace(eval_split=None))
    assert not any(loop.eval_due(ctx, s) for s in range(1, 11))  # type: ignore[arg-type]


# ---- the split, streamed -------------------------------------------------------------------------

ROWS = [{"prompt": f"q{i}", "data_source": "gsm8k" if i % 3 else "math", "answer": i} for i in range(7)]


def _jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_the_split_is_served_in_file_order_in_batches_up_to_max_prompts(tmp_path: Path, fmt: str) -> None:
    if fmt == "jsonl":
        path = _jsonl(tmp_path / "e.jsonl", ROWS)
    else:
        path = tmp_path / "e.parquet"
        pq.write_table(pa.Table.from_pylist(ROWS), path, row_group_size=2)
    split = EvalPrompts(str(path), "prompt", "answer")
    batches = list(split.batches(3))
    assert [b.prompts for b in batches] == [["q0", "q1", "q2"], ["q3", "q4", "q5"], ["q6"]]
    assert batches[0].labels == [0, 1, 2]
    assert batches[0].columns[1] == {"data_source": "gsm8k", "answer": 1}
    assert [b.prompts for b in split.batches(3)] == [b.prompts for b in batches]  # every evaluation: the same
    limited = EvalPrompts(str(path), "prompt", None, max_prompts=4)
    assert len(limited) == 4 and [p for b in limited.batches(3) for p in b.prompts] == [
        "q0",
        "q1",
        "q2",
        "q3",
    ]
    assert len(EvalPrompts(str(path), "prompt", None, max_prompts=100)) == 7


def test_a_bad_split_is_named_as_data_eval(tmp_path: Path) -> None:
    bad = tmp_path / "e.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"text": "no prompt"}\n')
    with pytest.raises(DatasetError, match=r"^data\.eval\.prompts .*e\.jsonl: line 2: no field 'prompt'"):
        EvalPrompts(str(bad), "prompt", None)
    with pytest.raises(DatasetError, match=r"^data\.eval\.prompts .*: unknown format \.csv"):
        EvalPrompts(str(tmp_path / "e.csv"), "prompt", None)


def test_preflight_opens_the_split_and_names_it(tmp_path: Path) -> None:
    from rlhf_trainer.tiny_model import make_tiny_model

    tiny = make_tiny_model(tmp_path / "tiny", num_prompts=8)
    raw = {
        "model": {
            "actor": tiny["model"],
            "reward": {"type": "function", "function": "rlhf_trainer.tasks.tiny:reward"},
        },
        "data": {"prompts": tiny["prompts"], "eval": {"prompts": tiny["eval"]}},
    }
    data = preflight(RLHFJobSpec.model_validate(raw))
    assert data.eval_split is not None and len(data.eval_split) == 16
    rows = [json.loads(line) for line in Path(tiny["eval"]).read_text().splitlines()]
    assert {r["data_source"] for r in rows} == {"short", "long"}
    raw["data"]["eval"] = {"prompts": str(tmp_path / "missing.jsonl")}  # type: ignore[index]
    with pytest.raises(InputError, match=r"^spec\.data\.eval\.prompts .*missing\.jsonl: cannot read"):
        preflight(RLHFJobSpec.model_validate(raw))


# ---- the tally -----------------------------------------------------------------------------------


def test_the_tally_is_overall_and_per_data_source_and_errors_count_apart() -> None:
    t = EvalTally()
    t.add([1.0, 0.0, None, 0.5], ["gsm8k", "gsm8k", "math", "math"])
    t.add([1.0, None], [None, "math"])  # a row without data_source: overall only
    assert (t.samples, t.errors, t.valid) == (6, 2, 4)
    assert t.reward_mean == pytest.approx(2.5 / 4)
    assert t.by_source() == {"gsm8k": 0.5, "math": 0.5}
    t.prompts = 3
    assert t.report(8) == {
        "step": 8, "reward_mean": 0.625, "prompts": 3, "samples": 6, "valid_samples": 4, "reward_errors": 2,
        "weights_behind": 0, "by_data_source": {"gsm8k": 0.5, "math": 0.5},
    }  # fmt: skip


def test_without_the_column_there_is_no_split_by_source() -> None:
    t = EvalTally()
    t.add([0.2, 0.4], [None, None])
    assert t.by_source() == {} and "by_data_source" not in t.report(1)
    assert t.reward_mean == pytest.approx(0.3)
    assert EvalTally().reward_mean == 0.0  # nothing valid: 0, as the training reward_mean


def test_a_chunks_scores_and_sources_line_up() -> None:
    result = RewardResult(torch.tensor([0.5, 0.0, 1.0]), torch.tensor([True, False, True]))
    assert chunk_scores(result) == [0.5, None, 1.0]
    assert source_of({"data_source": 3}) == "3" and source_of({"other": 1}) is None


# ---- the step loop: eval is its own phase and never a training sample ---------------------------


class _Data:
    """The training prompts (drawn through next_batch only) and the split."""

    def __init__(self) -> None:
        self.drawn = 0
        self.eval_split = object()

    def next_batch(self, n: int) -> Any:
        self.drawn += n
        raise AssertionError("generate_now is faked")


def _train_report(step: int) -> loop.StepReport:
    return loop.StepReport(step=step, phase_seconds={"generation": 0.5}, reward_mean=0.25, kl=0.0,
                           generated_tokens=320, trained_tokens=640, reward_errors=1, valid_samples=31,
                           tokens_per_second=10.0, step_seconds=1.0)  # fmt: skip


def test_run_step_times_eval_as_its_own_phase_and_never_counts_its_samples(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spec = _spec({"everySteps": 2})
    metrics = TrainerExporter("j")
    data = _Data()
    pool = SimpleNamespace(mark_lost=lambda *a: None, counts=dict)
    ctx = loop.StepContext(spec, "j", data, SimpleNamespace(pool=pool, reward="scorer"),  # type: ignore[arg-type]
                           SimpleNamespace(refresh=lambda timer: 0), None, metrics)  # type: ignore[arg-type]  # fmt: skip
    evaluated: list[tuple[int, dict[str, Any]]] = []

    def fake_train_on(ctx: Any, step: int, gen: Any, timer: Any, sync_bytes: int, started: float) -> Any:
        with timer.phase("actor_train"):
            pass
        metrics.generated_tokens.labels("j").inc(320)  # as generate() does for the training batch
        return _train_report(step)

    def fake_evaluate(
        split: Any, pool_: Any, reward: Any, sampling: dict[str, Any], step: int, lost: Any, **kw: Any
    ) -> Any:
        assert split is data.eval_split and pool_ is pool and reward == "scorer"
        evaluated.append((step, sampling))
        tally = EvalTally(prompts=16)
        tally.add([1.0] * 8 + [0.0] * 6 + [None] * 2, ["short"] * 8 + ["long"] * 8)
        return tally

    monkeypatch.setattr(loop, "generate_now", lambda ctx, step, timer: None)
    monkeypatch.setattr(loop, "train_on", fake_train_on)
    monkeypatch.setattr(loop, "evaluate", fake_evaluate)
    reports = [loop.run_step(ctx, step) for step in (1, 2)]

    assert [step for step, _ in evaluated] == [2]
    assert evaluated[0][1]["temperature"] == 0.0 and evaluated[0][1]["n"] == 1
    first, second = reports
    assert first.evaluation == {} and "eval" not in first.phase_seconds
    assert second.evaluation["reward_mean"] == pytest.approx(8 / 14)
    assert second.evaluation["by_data_source"] == {"short": 1.0, "long": 0.0}
    assert second.evaluation["samples"] == 16 and second.evaluation["reward_errors"] == 2
    assert second.phase_seconds["eval"] >= 0.0 and "actor_train" in second.phase_seconds
    # the training figures are train_on's, whatever the evaluation generated and scored
    for r in reports:
        assert (r.valid_samples, r.generated_tokens, r.trained_tokens, r.reward_errors, r.reward_mean) == (
            31, 320, 640, 1, 0.25,
        )  # fmt: skip
    assert data.drawn == 0  # the evaluation draws nothing from the training prompts
    scrape = metrics.registry
    text = __import__("prometheus_client").generate_latest(scrape).decode()
    assert metric_value(text, "rlhf_generated_tokens_total") == 640  # two training batches, no eval tokens
    assert metric_value(text, "rlhf_reward_errors_total") == 0  # train_on counts its own; eval's apart
    assert metric_value(text, "rlhf_eval_reward_errors_total") == 2
    assert metric_value(text, "rlhf_eval_reward_mean") == pytest.approx(8 / 14)
    assert metric_value(text, "rlhf_eval_source_reward_mean", data_source="short") == 1.0
    assert metric_value(text, "rlhf_eval_step") == 2
    assert metric_value(text, "rlhf_step_phase_seconds", phase="eval") >= 0.0
    assert metric_value(text, "rlhf_steps_completed_total") == 2
    assert "eval" in PHASES


def test_no_eval_series_before_the_first_evaluation() -> None:
    text = __import__("prometheus_client").generate_latest(TrainerExporter("j").registry).decode()
    assert "rlhf_eval_reward_mean{" not in text and "rlhf_eval_step{" not in text
    assert 'rlhf_step_phase_seconds{phase="eval",rlhfjob="j"}' in text


def test_the_step_line_and_summary_carry_the_evaluation_only_where_it_ran() -> None:
    from rlhf_trainer.driver import eval_fields, step_summary

    r = _train_report(3)
    assert (
        eval_fields(r) == {} and step_summary(r)["eval"] == {} and "eval_reward_mean" not in step_summary(r)
    )
    r.evaluation = {"reward_mean": 0.5, "by_data_source": {"a": 0.25, "b": 0.75}, "samples": 4}
    assert eval_fields(r) == {
        "eval_reward_mean": 0.5,
        "eval_reward_mean_by_data_source": {"a": 0.25, "b": 0.75},
    }
    summary = step_summary(r)
    assert summary["eval_reward_mean"] == 0.5 and summary["eval"]["samples"] == 4
    assert summary["valid_samples"] == 31  # the training figures as they were
    r.evaluation = {"reward_mean": 0.5}  # no data_source column
    assert eval_fields(r) == {"eval_reward_mean": 0.5}
