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


@pytest.mark.parametrize("pod_slots", [True, False])
def test_groups_ask_for_their_pod_roles_slot_even_before_those_pods_join(
    monkeypatch: pytest.MonkeyPatch, pod_slots: bool
) -> None:
    """After a head pod's loss the worker pods rejoin the new head one by one: with only a rollout pod back,
    a trainer group that did not ask for rlhf_trainer_slot took the rollout pod's GPU, and the engine
    waited for it forever (the real-node run of 2026-11-28). In the operator's RayCluster (RLHF_POD_SLOTS)
    each group asks for its role's slot whether or not a pod advertising it has joined yet."""
    from rlhf_api.constants import POD_SLOTS_ENV, ROLLOUT_RESOURCE, TRAINER_RESOURCE
    from rlhf_trainer import placement
    from rlhf_trainer.device_plan import Pool

    joined = {"CPU": 4.0, "GPU": 1.0, ROLLOUT_RESOURCE: 1.0}  # only the rollout pod is back
    monkeypatch.setattr(placement.ray, "cluster_resources", lambda: joined)
    if pod_slots:
        monkeypatch.setenv(POD_SLOTS_ENV, "1")
    else:
        monkeypatch.delenv(POD_SLOTS_ENV, raising=False)
    trainer = placement.pool_bundles(Pool("actor", "trainer", 2), {}, 0.5)
    rollout = placement.pool_bundles(Pool("engine-0", "rollout", 1), {}, 0.5)
    assert all((TRAINER_RESOURCE in b) == pod_slots for b in trainer), trainer
    assert rollout[0][ROLLOUT_RESOURCE] == 1.0  # advertised now either way


def test_a_local_head_with_no_slots_places_without_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """The development override's local Ray head advertises no slots and its driver gets no RLHF_POD_SLOTS."""
    from rlhf_api.constants import POD_SLOTS_ENV, ROLLOUT_RESOURCE, TRAINER_RESOURCE
    from rlhf_trainer import placement
    from rlhf_trainer.device_plan import Pool

    monkeypatch.setattr(placement.ray, "cluster_resources", lambda: {"CPU": 16.0, "GPU": 16.0})
    monkeypatch.delenv(POD_SLOTS_ENV, raising=False)
    bundles = placement.pool_bundles(Pool("actor", "trainer", 2), {}, 1.0) + placement.pool_bundles(
        Pool("engine-0", "rollout", 1), {}, 1.0
    )
    assert not any(TRAINER_RESOURCE in b or ROLLOUT_RESOURCE in b for b in bundles), bundles
