"""Device sharing of colocated roles (rlhf_trainer.placement.sharers_per_device): derived from the spec."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from rlhf_api.spec import RLHFJobSpec
from rlhf_trainer.cli import apply_overrides
from rlhf_trainer.placement import sharers_per_device

pytestmark = pytest.mark.unit

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "rlhfjob-tiny.yaml"
REWARD_MODEL = ["model.reward.type=model", "model.reward.model=/models/rm", "model.reward.function=null"]


def _spec(*sets: str) -> Any:
    manifest = apply_overrides(yaml.safe_load(EXAMPLE.read_text()), list(sets))
    return RLHFJobSpec.model_validate(manifest["spec"], by_alias=True, by_name=False)


def _shares(spec: Any) -> dict[str, int]:
    out = {"+".join(roles): sharers_per_device(spec, roles) for roles, _ in spec.gpu_groups()}
    out["engine"] = sharers_per_device(spec, ("engine",))
    return out


def test_separate_groups_own_their_devices() -> None:
    assert _shares(_spec()) == {"actor+reference": 1, "critic": 1, "engine": 1}
    assert _shares(_spec(*REWARD_MODEL, "trainer.colocateCriticReward=false")) == {
        "actor+reference": 1, "critic": 1, "reward": 1, "engine": 1,
    }  # fmt: skip


def test_reward_model_colocated_with_the_critic_halves_its_devices() -> None:
    spec = _spec(*REWARD_MODEL, "trainer.colocateCriticReward=true")
    assert _shares(spec) == {"actor+reference": 1, "critic+reward": 2, "engine": 1}
    assert sharers_per_device(spec, ("reward",)) == 2
    # without a critic (grpo) the reward model has its devices to itself
    grpo = _spec(*REWARD_MODEL, "trainer.colocateCriticReward=true", "algorithm.advantageEstimator=grpo",
                 "model.critic=null", "trainer.critic=null")  # fmt: skip
    assert sharers_per_device(grpo, ("reward",)) == 1


def test_colocate_all_shares_every_actor_device_with_an_engine() -> None:
    spec = _spec("trainer.colocateAll=true", "trainer.critic=null", "rollout.engines=2")
    assert _shares(spec) == {"actor+critic+reference": 2, "engine": 2}
    with_rm = _spec("trainer.colocateAll=true", "trainer.critic=null", "rollout.engines=2", *REWARD_MODEL)
    assert sharers_per_device(with_rm, ("engine",)) == 3 and sharers_per_device(with_rm, ("reward",)) == 3


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
