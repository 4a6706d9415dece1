"""Reward loading and error counting (rlhf_trainer.workers.reward) and the tiny task's reward."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from rlhf_trainer.tasks.tiny import reward as tiny_reward  # noqa: E402
from rlhf_trainer.transfer import PackedRollout  # noqa: E402
from rlhf_trainer.workers.reward import RewardScorer, RewardSetupError, load_reward_function  # noqa: E402

pytestmark = pytest.mark.unit


def _rollout(responses: list[str]) -> PackedRollout:
    return PackedRollout.from_samples([([1], [2], [0.0]) for _ in responses], list(range(len(responses))),
                                      ["p"] * len(responses), responses)


def test_tiny_reward_is_vowel_share() -> None:
    assert tiny_reward(["x", "y", "z"], ["aeiou", "bcd a", ""]) == [1.0, 0.25, 0.0]


def test_load_by_module_and_file(tmp_path: Path) -> None:
    assert load_reward_function("rlhf_trainer.tasks.tiny:reward") is tiny_reward
    f = tmp_path / "r.py"
    f.write_text("def score(prompts, responses):\n    return [1.0] * len(responses)\n")
    assert load_reward_function(f"{f}:score")(["a"], ["b"]) == [1.0]


@pytest.mark.parametrize("ref, needle", [
    ("no_such_module_xyz:fn", "no_such_module_xyz"),
    ("rlhf_trainer.tasks.tiny:nope", "'nope'"),
    ("/does/not/exist.py:fn", "/does/not/exist.py"),
])
def test_bad_reward_names_the_function(ref: str, needle: str) -> None:
    with pytest.raises(RewardSetupError, match="model.reward.function") as e:
        load_reward_function(ref)
    assert needle in str(e.value)


def test_errors_are_counted_never_scored(tmp_path: Path) -> None:
    f = tmp_path / "flaky.py"
    f.write_text(
        "def reward(prompts, responses):\n"
        "    if any('boom' in r for r in responses):\n"
        "        raise RuntimeError('boom in reward')\n"
        "    return [float('nan') if r == 'nan' else 1.0 for r in responses]\n")
    scorer = RewardScorer({"type": "function", "function": f"{f}:reward", "timeout_seconds": 5})
    meta, result = scorer.score(0, _rollout(["ok", "boom", "nan", "ok"]))
    assert meta.errors == 2 and meta.samples == 4
    assert result.valid.tolist() == [True, False, False, True]
    assert "boom in reward" in " ".join(meta.messages)
    assert meta.score_sum == 2.0


def test_labels_passed_when_accepted(tmp_path: Path) -> None:
    f = tmp_path / "lab.py"
    f.write_text("def reward(prompts, responses, labels):\n    return [float(l == r) for r, l in zip(responses, labels)]\n")
    scorer = RewardScorer({"type": "function", "function": f"{f}:reward"})
    r = _rollout(["a", "b"])
    r.labels = ["a", "x"]
    _, result = scorer.score(0, r)
    assert result.scores.tolist() == [1.0, 0.0]
