"""Placement's spec-derived settings: the reward scorer's configuration. (Devices: test_device_plan.py.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from rlhf_api.spec import RLHFJobSpec
from rlhf_trainer.cli import apply_overrides

pytestmark = pytest.mark.unit

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "rlhfjob-tiny.yaml"


def _spec(*sets: str) -> Any:
    manifest = apply_overrides(yaml.safe_load(EXAMPLE.read_text()), list(sets))
    return RLHFJobSpec.model_validate(manifest["spec"], by_alias=True, by_name=False)


def test_the_scorer_applies_the_specs_reward_timeout_and_concurrency(tmp_path: Path) -> None:
    """The spec dumps by its CRD aliases (timeoutSeconds); the scorer must get the user's values, not
    defaults: a hanging reward with timeoutSeconds 3600 must hang, not be cut at 30 s."""
    from rlhf_trainer.placement import reward_config
    from rlhf_trainer.workers.reward import RewardScorer

    f = tmp_path / "r.py"
    f.write_text("def reward(prompts, responses):\n    return [0.0] * len(responses)\n")
    spec = _spec(
        "model.reward.type=function",
        f"model.reward.function={f}:reward",
        "model.reward.timeoutSeconds=3600",
        "model.reward.concurrency=7",
    )
    scorer = RewardScorer(reward_config(spec))
    assert (scorer.timeout, scorer.threads) == (3600.0, 7)
    with pytest.raises(KeyError):  # what the scorer was given before: the aliases, silently ignored
        RewardScorer(spec.model.reward.model_dump())
