"""The objective's plumbing around the formulas (which test_objectives_reference.py checks): dynamic
sampling's choice and composition of groups, the state carried across steps (adaptive KL, running score
moments) and its restore, reward shaping on the ranks, the rank-side count of zero-advantage groups,
and the spec's wire to the ranks. The end-to-end run is tests/e2e/ray (the GRPO run)."""

from __future__ import annotations

import pickle
from dataclasses import MISSING, fields, replace
from typing import Any

import pytest
import torch
from rlhf_api.spec import RLHFJobSpec
from rlhf_trainer import algorithms, experience
from rlhf_trainer import dynamic_sampling as dynamic
from rlhf_trainer.config import algorithm_settings
from rlhf_trainer.loop import ObjectiveState, advance
from rlhf_trainer.step_settings import AlgorithmSettings, RewardShaping, RolloutCorrection
from rlhf_trainer.transfer import PackedRollout
from rlhf_trainer.workers.policy import PolicyLoss
from rlhf_trainer.workers.reward_results import RewardResult

pytestmark = pytest.mark.unit


def _spec(**algorithm: Any) -> RLHFJobSpec:
    return RLHFJobSpec.model_validate(
        {
            "model": {"actor": "/m", "reward": {"type": "function", "function": "r:f"}},
            "data": {"prompts": "/p.jsonl"},
            "algorithm": {"rolloutBatchSize": 4, "samplesPerPrompt": 2, **algorithm},
        }
    )


# ---- dynamic sampling ------------------------------------------------------------------------------
def test_a_group_is_informative_only_when_two_valid_rewards_differ() -> None:
    result = RewardResult(
        scores=torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.0, 0.0, 0.0]),
        valid=torch.tensor([True, True, True, True, True, False, True, True]),
    )
    # [1, 1] equal; [0, 1] differ; [0.5, x] one valid sample: no baseline; [0, 0] equal
    assert dynamic.chunk_groups(result, 2) == [False, True, False, False]


def test_pick_takes_informative_groups_in_order_then_fills_short() -> None:
    rounds = [[[False, True], [True, False]], [[False, False], [True, True]]]
    full = dynamic.pick(rounds, 3)
    assert full.groups == [dynamic.GroupRef(0, 0, 1), dynamic.GroupRef(0, 1, 0), dynamic.GroupRef(1, 1, 0)]
    assert (full.informative, full.short, full.dropped) == (3, 0, 4)
    short = dynamic.pick([[[False, True], [False, False]]], 3)  # the rounds ran out: equal groups fill in
    assert short.groups == [dynamic.GroupRef(0, 0, 1), dynamic.GroupRef(0, 0, 0), dynamic.GroupRef(0, 1, 0)]
    assert (short.informative, short.short, short.dropped) == (1, 2, 1)


def _chunk(first: int, groups: int, n: int) -> tuple[PackedRollout, RewardResult]:
    samples = []
    for g in range(groups):
        for i in range(n):
            samples.append(([first + g, 1], [10 * (first + g) + i] * (i + 1), [-0.1 * (i + 1)] * (i + 1)))
    packed = PackedRollout.from_samples(samples, [first + g for g in range(groups) for _ in range(n)],
                                        finished=[True] * (groups * n))  # fmt: skip
    scores = torch.arange(groups * n, dtype=torch.float32) + 100 * first
    return packed, RewardResult(scores, torch.ones(groups * n, dtype=torch.bool))


def test_compose_takes_the_named_groups_tokens_scores_and_renumbers_them() -> None:
    n = 2
    a, b = _chunk(0, 3, n), _chunk(7, 2, n)
    out, result, meta = dynamic.compose(
        5, 1, 0, 8, n, [(a[0], a[1], [2]), (b[0], b[1], [0, 1])], get=lambda x: x
    )
    assert out.num_samples == 6
    assert out.group.tolist() == [8, 8, 9, 9, 10, 10]  # renumbered from first_group
    # the prompts' first tokens name the source groups: a's group 2, then b's groups 7 and 8
    starts = out.offsets()[:-1].tolist()
    assert [int(out.tokens[s]) for s in starts] == [2, 2, 7, 7, 8, 8]
    assert result.scores.tolist() == [4.0, 5.0, 700.0, 701.0, 702.0, 703.0]
    assert out.rollout_logprobs.numel() == int(out.response_lens.sum())
    assert (meta.chunk, meta.rank, meta.samples, meta.digest) == (5, 1, 6, out.digest())


# ---- state across steps ------------------------------------------------------------------------------
def test_adaptive_kl_moves_the_coefficient_and_a_resume_goes_on_from_it() -> None:
    spec = _spec(klCoef=0.1, klTarget=0.02, klHorizon=80)
    state = ObjectiveState.restore(spec, None)
    stats = [{"valid": 8.0}]
    advance(state, spec, stats, kl=0.04)  # KL above target: the error is clipped to +0.2
    assert state.kl_coef == pytest.approx(0.1 * (1 + 0.2 * 8 / 80))
    advance(state, spec, stats, kl=0.018)  # below: -0.1
    assert state.kl_coef == pytest.approx(0.1 * (1 + 0.2 * 8 / 80) * (1 - 0.1 * 8 / 80))
    resumed = ObjectiveState.restore(spec, {"kl_coef": state.kl_coef})
    assert resumed.kl_coef == state.kl_coef
    fixed = _spec(klCoef=0.1)
    kept = ObjectiveState.restore(fixed, None)
    advance(kept, fixed, stats, kl=0.5)
    assert kept.kl_coef == 0.1  # no klTarget: the coefficient stays


def test_running_moments_merge_batches_as_one_population() -> None:
    g = torch.Generator().manual_seed(3)
    batches = [torch.randn(n, generator=g) * 2 + 1 for n in (5, 9, 1, 14)]
    m = algorithms.RunningMoments()
    for b in batches:
        m = m.merged(algorithms.whitening_moments([b]))
    every = torch.cat(batches).double()
    assert m.count == every.numel()
    assert m.mean == pytest.approx(float(every.mean()), abs=1e-9)
    assert m.std == pytest.approx(float(every.std(unbiased=False)), abs=1e-9)


def _shard(scores: list[float], lens: list[int], groups: list[int]) -> experience.ShardInputs:
    return experience.ShardInputs(
        scores=torch.tensor(scores),
        valid=torch.ones(len(scores), dtype=torch.bool),
        response_lens=torch.tensor(lens),
        group=torch.tensor(groups),
    )


def test_shaping_clips_penalises_overlong_then_normalises_over_every_rank() -> None:
    spec = _spec(
        maxResponseLength=10,
        rewardShaping={"clip": 1.0, "overlongBuffer": 4, "overlongPenalty": 0.5, "normalize": True},
        advantageEstimator="rloo",
    )
    # earlier steps: mean 0, std 1
    algo = replace(algorithm_settings(spec), score_moments={"count": 4.0, "mean": 0.0, "m2": 4.0})
    shards = {0: _shard([3.0, 0.2], [5, 8], [0, 0]), 1: _shard([-0.5, 0.4], [10, 2], [1, 1])}
    # what both "ranks" contribute: an all-reduce of the two shards' moments is their sum, here
    shaped = [1.0, 0.2 - 0.25, -0.5 - 0.5, 0.4]  # clip 3 -> 1; 8 tokens: (6 - 8) / 4 * 0.5; 10: -0.5
    out, stats = experience.compute(shards, algo)
    expect = algorithms.RunningMoments(4.0, 0.0, 4.0).merged(
        algorithms.whitening_moments([torch.tensor(shaped)])
    )
    got = stats.score_moments
    assert got is not None
    assert (got.count, got.mean, got.m2) == pytest.approx((expect.count, expect.mean, expect.m2), abs=1e-6)
    normed = [(x - expect.mean) / (expect.std + algorithms.EPS) for x in shaped]
    # rloo over groups of two: a_i = s_i - s_other
    assert out[0].advantages[0] == pytest.approx(normed[0] - normed[1], abs=1e-5)
    assert out[1].advantages[-1] == pytest.approx(normed[3] - normed[2], abs=1e-5)
    assert stats.score_sum == pytest.approx(3.0 + 0.2 - 0.5 + 0.4)  # reported: the rewards as given


def test_the_ranks_count_groups_whose_advantages_are_all_zero() -> None:
    algo = algorithm_settings(_spec())
    scores = [1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 0.0, 0.5, 1.0]
    shard = _shard(scores, [2, 3, 2, 2, 1, 4, 1, 1, 1], [0, 0, 1, 1, 2, 2, 3, 3, 3])
    out, stats = experience.compute({0: shard}, algo)
    # groups 0 and 2 score equal; group 3's middle sample sits on its mean (advantage 0), the others not
    assert stats.zero_advantage_groups == 2.0
    assert float(out[0].advantages.abs().sum()) > 0


# ---- the wire ---------------------------------------------------------------------------------------------
def test_the_policy_loss_settings_come_from_the_spec() -> None:
    spec = _spec(
        clipRange=0.2, clipRangeHigh=0.28, dualClip=3.0, entropyCoef=0.01, klCoef=0.05,
        klEstimatorLoss="k2", lossAggregation="seq-mean-token-sum-norm", maxResponseLength=64,
        rolloutCorrection={"level": "sequence", "mode": "mask", "lowerBound": 0.5, "upperBound": 3.0},
    )  # fmt: skip
    loss = PolicyLoss.from_settings(algorithm_settings(spec))
    assert loss == PolicyLoss(
        policy_loss="ppo", clip_low=0.2, clip_high=0.28, dual_clip=3.0, entropy_coef=0.01, kl_loss_coef=0.05,
        kl_estimator="k2", aggregation="seq-mean-token-sum-norm", norm_constant=64.0,
        correction=RolloutCorrection(level="sequence", mode="mask", lower=0.5, upper=3.0),
    )  # fmt: skip
    # gae and the reinforce_pp family put the KL in the reward, not the loss; no correction when off
    reward_kl = PolicyLoss.from_settings(algorithm_settings(_spec(advantageEstimator="reinforce_pp", klCoef=0.05,
                                                          rolloutCorrection={"enabled": False})))  # fmt: skip
    assert (reward_kl.kl_loss_coef, reward_kl.correction) == (0.0, None)


@pytest.mark.parametrize("settings", [AlgorithmSettings, RewardShaping, RolloutCorrection, PolicyLoss])
def test_the_step_settings_have_no_defaults_of_their_own(settings: type) -> None:
    """The spec model holds the only defaults: a settings class that restated one could drift from it."""
    assert [
        f.name for f in fields(settings) if f.default is not MISSING or f.default_factory is not MISSING
    ] == []


def test_the_step_settings_carry_the_specs_values_and_cross_ray_as_they_are() -> None:
    spec = _spec(miniBatchesPerEpoch=2, lossAggregation="seq-mean-token-mean", klEstimatorReward="k2")
    algo = algorithm_settings(spec)
    assert (algo.mini_batches, algo.loss_aggregation, algo.kl_reward_estimator) == (
        2,
        "seq-mean-token-mean",
        "k2",
    )
    assert pickle.loads(pickle.dumps(replace(algo, step=3))) == replace(algo, step=3)
