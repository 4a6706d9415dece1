"""Advantage estimators, KL and losses (rlhf_trainer.algorithms): pure torch, no Ray."""

from __future__ import annotations

import math

import pytest
import torch
from rlhf_trainer import algorithms as A

pytestmark = pytest.mark.unit


def test_gae_matches_hand_computation() -> None:
    r = [torch.tensor([0.0, 0.0, 1.0])]
    v = [torch.tensor([0.5, 0.6, 0.7])]
    out = A.gae(r, v, gamma=1.0, lam=1.0)
    # lam=gamma=1: advantage = return - value, return = 1 everywhere
    assert torch.allclose(out.advantages[0], torch.tensor([0.5, 0.4, 0.3]))
    assert torch.allclose(out.returns[0], torch.ones(3))


def test_gae_lambda_zero_is_one_step_td() -> None:
    r = [torch.tensor([0.1, 0.2])]
    v = [torch.tensor([1.0, 2.0])]
    out = A.gae(r, v, gamma=0.9, lam=0.0)
    assert torch.allclose(out.advantages[0], torch.tensor([0.1 + 0.9 * 2.0 - 1.0, 0.2 - 2.0]))


def test_grpo_normalises_within_groups_and_skips_invalid() -> None:
    scores = torch.tensor([1.0, 0.0, 5.0, 5.0, 9.0])
    groups = torch.tensor([0, 0, 1, 1, 1])
    valid = torch.tensor([True, True, True, True, False])
    out = A.grpo(scores, groups, [2, 3, 1, 1, 4], valid)
    a = [float(x[0]) for x in out.advantages]
    # group {1, 0}: mean 0.5, unbiased std sqrt(0.5) -> +-0.5 / sqrt(0.5) = +-1/sqrt(2)
    assert a[0] == pytest.approx(2**-0.5, abs=1e-4) and a[1] == pytest.approx(-(2**-0.5), abs=1e-4)
    assert a[2] == 0.0 and a[3] == 0.0  # equal scores: no signal
    assert torch.equal(out.advantages[4], torch.zeros(4))  # invalid sample never trained on
    assert [x.numel() for x in out.advantages] == [2, 3, 1, 1, 4]


@pytest.mark.parametrize("baseline", [False, True])
def test_reinforce_pp_returns_to_go_whitened(baseline: bool) -> None:
    scores = torch.tensor([1.0, 0.0])
    groups = torch.tensor([0, 0])
    kls = [torch.zeros(3), torch.zeros(2)]
    out = A.reinforce_pp(scores, groups, kls, kl_coef=0.1, gamma=1.0, baseline=baseline)
    cat = torch.cat(out.advantages)
    assert float(cat.mean()) == pytest.approx(0.0, abs=1e-5)
    assert float(cat.std(unbiased=False)) == pytest.approx(1.0, abs=1e-3)
    assert bool((out.advantages[0] > 0).all()) and bool((out.advantages[1] < 0).all())


def test_grpo_std_is_unbiased_with_verl_epsilon() -> None:
    # {0, 1, 2}: unbiased std 1 -> advantages -1, 0, 1 (the population std 0.816 would give +-1.22)
    out = A.grpo(torch.tensor([0.0, 1.0, 2.0]), torch.tensor([7, 7, 7]), [1, 1, 1])
    a = torch.cat(out.advantages)
    assert torch.allclose(a, torch.tensor([-1.0, 0.0, 1.0]) / (1.0 + A.GRPO_STD_EPS), atol=1e-7)


def test_whitening_with_summed_moments_equals_whitening_the_whole_batch() -> None:
    g = torch.Generator().manual_seed(3)
    values = [torch.randn(n, generator=g) * 3 + 1 for n in (4, 7, 2, 5, 3)]
    valid = torch.tensor([True, False, True, True, True])
    whole = A.whiten(values, valid)
    # two "ranks" hold samples 0-1 and 2-4; their moments add up (the all-reduce)
    moments = A.whitening_moments(values[:2], valid[:2]) + A.whitening_moments(values[2:], valid[2:])
    split = A.whiten_with(values[:2], moments, valid[:2]) + A.whiten_with(values[2:], moments, valid[2:])
    for w, s in zip(whole, split, strict=True):
        assert torch.allclose(w, s, atol=1e-6)
    shard_only = A.whiten(values[2:], valid[2:])  # per-shard whitening differs: the point of the moments
    assert not torch.allclose(shard_only[0], split[2], atol=1e-3)
    assert torch.equal(split[1], torch.zeros(7))


@pytest.mark.parametrize("baseline", [False, True])
def test_reinforce_pp_is_whitened_returns(baseline: bool) -> None:
    scores, groups = torch.tensor([1.0, 0.0, 3.0]), torch.tensor([0, 0, 0])
    kls = [torch.full((3,), 0.1), torch.zeros(2), torch.zeros(4)]
    rets = A.reinforce_pp_returns(scores, groups, kls, 0.1, 1.0, baseline=baseline)
    out = A.reinforce_pp(scores, groups, kls, 0.1, 1.0, baseline=baseline)
    for a, b in zip(out.advantages, A.whiten(rets), strict=True):
        assert torch.allclose(a, b)
    # the last token's reward: the score (REINFORCE++) or the score minus the group mean 4/3 (the baseline)
    last = [float(r[-1]) for r in rets]
    expected = [s - (4.0 / 3.0 if baseline else 0.0) for s in (1.0, 0.0, 3.0)]
    assert last == pytest.approx([expected[0] - 0.01, expected[1], expected[2]], abs=1e-6)


def test_token_rewards_put_score_on_last_token() -> None:
    r = A.token_rewards(2.0, torch.tensor([0.1, 0.2]), kl_coef=0.5)
    assert torch.allclose(r, torch.tensor([-0.05, 2.0 - 0.1]))


def test_kl_estimators() -> None:
    lp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.0, -1.0])
    assert torch.allclose(A.kl_per_token(lp, ref, "k1"), torch.tensor([0.0, -1.0]))
    k3 = A.kl_per_token(lp, ref, "k3")
    assert float(k3[0]) == 0.0 and float(k3[1]) > 0
    assert torch.allclose(A.kl_per_token(lp, ref, "k2"), torch.tensor([0.0, 0.5]))
    with pytest.raises(ValueError, match="k4"):
        A.kl_per_token(lp, ref, "k4")


def test_k3_kl_is_clamped_to_ten() -> None:
    # log(pi/ref) = -5: r = ref/pi = e^5, k3 = e^5 - 1 - 5 = 142.4 unclamped
    k3 = A.kl_per_token(torch.tensor([-6.0, -1.0]), torch.tensor([-1.0, -1.0]), "k3")
    assert float(k3[0]) == A.K3_CLAMP == 10.0
    huge = A.kl_per_token(torch.tensor([-200.0]), torch.tensor([0.0]), "k3")
    assert float(huge[0]) == 10.0


def test_policy_loss_clamps_the_log_ratio_before_exp() -> None:
    # a token whose log-prob rose by 100 nats since sampling: exp(100) overflows fp32 to inf
    lp = torch.tensor([[100.0, 0.0]], requires_grad=True)
    old, adv, mask = torch.zeros(1, 2), torch.tensor([[-1.0, 1.0]]), torch.ones(1, 2)
    loss, clipped = A.policy_loss(lp, old, adv, mask, clip=0.2)
    assert float(loss.detach()) == pytest.approx(
        math.exp(20.0) - 1.0, rel=1e-6
    )  # ratio e^20 on the first token
    (grad,) = torch.autograd.grad(loss, lp)
    assert bool(torch.isfinite(grad).all())
    # A < 0 with the ratio far above 1 + clip: the unclipped term is the larger loss, so the clip does not
    # bind there (nothing bounds it but the clamp) ...
    assert float(clipped) == 0.0
    # ... which is what the dual clip is for: the loss of A < 0 capped at -c A
    capped = A.ppo_tokens(lp, old, adv, 0.2, dual_clip=3.0)
    assert capped.loss.detach().tolist() == [[3.0, -1.0]] and capped.dual_clipped.tolist() == [[1.0, 0.0]]


def test_policy_loss_clips() -> None:
    old = torch.zeros(1, 2)
    lp = torch.log(torch.tensor([[2.0, 0.5]]))
    adv = torch.ones(1, 2)
    mask = torch.ones(1, 2)
    loss, clipped = A.policy_loss(lp, old, adv, mask, clip=0.2)
    assert float(loss) == pytest.approx(-(1.2 + 0.5))
    # the clip binds on r = 2 (A > 0, capped at 1.2); r = 0.5 is outside the range too, but with A > 0 the
    # unclipped 0.5 is the term taken: it does not count
    assert float(clipped) == 1.0
    _, clipped = A.policy_loss(lp, old, -adv, mask, clip=0.2)
    assert float(clipped) == 1.0  # and the other way round with A < 0: r = 0.5 binds at 0.8, r = 2 does not


def test_aggregation_modes_on_a_hand_example() -> None:
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])  # padded; 3rd invalid
    assert float(A.aggregate_loss(loss, mask, "token-mean")) == pytest.approx(10.0 / 4)
    assert float(A.aggregate_loss(loss, mask, "seq-mean-token-mean")) == pytest.approx((2.0 + 4.0) / 2)
    assert float(A.aggregate_loss(loss, mask, "seq-mean-token-sum")) == pytest.approx((6.0 + 4.0) / 2)
    assert A.loss_normaliser(mask, "token-mean") == 4.0
    assert A.loss_normaliser(mask, "seq-mean-token-sum") == 2.0
    with pytest.raises(ValueError, match="token-sum"):
        A.aggregate_loss(loss, mask, "token-sum")


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_global_normaliser_makes_shards_add_up_to_the_batch(mode: str) -> None:
    g = torch.Generator().manual_seed(5)
    loss = torch.rand(6, 5, generator=g)
    lens = torch.tensor([5, 1, 3, 0, 2, 4])  # one sample with no token (invalid)
    mask = (torch.arange(5).unsqueeze(0) < lens.unsqueeze(1)).float()
    whole = A.aggregate_loss(loss, mask, mode)
    shards = [slice(0, 1), slice(1, 4), slice(4, 6)]  # uneven "ranks"
    total = sum(A.loss_normaliser(mask[s], mode) for s in shards)  # the all-reduce
    summed = sum(float(A.aggregate_loss(loss[s], mask[s], mode, total)) for s in shards)
    assert summed == pytest.approx(float(whole), rel=1e-6)
    per_shard_mean = sum(float(A.aggregate_loss(loss[s], mask[s], mode)) for s in shards) / len(shards)
    assert per_shard_mean != pytest.approx(float(whole), rel=1e-3)  # what a per-rank mean would give


def test_seq_tokens_give_sequence_means_over_column_slices() -> None:
    loss = torch.tensor([[1.0, 2.0, 3.0, 6.0]])
    mask = torch.ones(1, 4)
    whole = A.aggregate_loss(loss, mask, "seq-mean-token-mean")
    full = torch.tensor([4.0])  # each SP rank holds 2 of the 4 columns
    halves = [
        A.aggregate_loss(loss[:, c], mask[:, c], "seq-mean-token-mean", 1.0, full)
        for c in (slice(0, 2), slice(2, 4))
    ]
    assert float(sum(halves)) == pytest.approx(float(whole)) == 3.0


def test_value_loss_clipped() -> None:
    v = torch.tensor([[2.0]])
    loss = A.value_loss(v, torch.tensor([[0.0]]), torch.tensor([[0.0]]), torch.ones(1, 1), clip=0.5)
    assert float(loss) == pytest.approx(0.5 * 4.0)


@pytest.mark.parametrize("schedule", ["constant", "cosine", "linear"])
def test_lr_schedule_warmup_then_decay(schedule: str) -> None:
    f = A.lr_lambda(schedule, warmup_steps=2, total_steps=10)
    assert f(0) == pytest.approx(0.5) and f(1) == pytest.approx(1.0)
    assert f(2) == pytest.approx(1.0)
    if schedule != "constant":
        assert f(10) == pytest.approx(0.0, abs=1e-6)


# ---- off-policy correction (issue 19): rollout importance weights (truncated / masked IS) ---------------


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_with_staleness_zero_the_weighted_objective_is_the_synchronous_one_exactly(
    level: str, mode: str
) -> None:
    torch.manual_seed(0)
    new, old, adv = torch.randn(4, 16) * 0.1, torch.randn(4, 16) * 0.1, torch.randn(4, 16)
    mask = (torch.arange(16) < torch.tensor([[16], [9], [1], [0]])).float()
    sync_loss, _ = A.policy_loss_tokens(new, old, adv, 0.2)
    weight, kept = A.rollout_weights(old, old.clone(), mask, level, mode, 0.5, 2.0)
    assert torch.equal(weight, torch.ones(4, 16)) and torch.equal(kept, torch.ones(4, 16))
    assert torch.equal(sync_loss * weight, sync_loss)


def test_stale_samples_are_weighted_by_proximal_over_behaviour_and_capped() -> None:
    prox = torch.zeros(1, 3)
    behav = torch.log(torch.tensor([[1.0, 0.5, 0.1]]))  # weights pi_prox / pi_behav = 1, 2, 10
    mask = torch.ones(1, 3)
    weight, kept = A.rollout_weights(prox, behav, mask, "token", "mask", 0.0, 5.0)
    assert kept.tolist() == [[1.0, 1.0, 0.0]]  # masked IS drops the token over the cap
    assert torch.allclose(weight, torch.tensor([[1.0, 2.0, 0.0]]))
    weight, kept = A.rollout_weights(prox, behav, mask, "token", "truncate", 0.0, 5.0)
    assert kept.tolist() == [[1.0, 1.0, 1.0]]  # truncated IS keeps it, its weight clamped to the cap
    assert torch.allclose(weight, torch.tensor([[1.0, 2.0, 5.0]]))
    # sequence level: one weight per row, the product 1 * 2 * 10 = 20, over the cap
    weight, kept = A.rollout_weights(prox, behav, mask, "sequence", "mask", 0.0, 5.0)
    assert kept.tolist() == [[0.0, 0.0, 0.0]] and weight.tolist() == [[0.0, 0.0, 0.0]]
    weight, kept = A.rollout_weights(prox, behav, mask, "sequence", "truncate", 0.0, 5.0)
    assert torch.allclose(weight, torch.full((1, 3), 5.0)) and kept.tolist() == [[1.0, 1.0, 1.0]]
    with pytest.raises(ValueError, match="naive"):
        A.rollout_weights(prox, behav, mask, "naive", "mask", 0.0, 5.0)
    with pytest.raises(ValueError, match="naive"):
        A.rollout_weights(prox, behav, mask, "token", "naive", 0.0, 5.0)


# ---- the vectorised group estimators against a loop over the groups --------------------------------------
def _loop_group_scores(
    scores: torch.Tensor, groups: torch.Tensor, valid: torch.Tensor, kind: str
) -> torch.Tensor:
    """Per sample, one group at a time in Python (float64): 'grpo' (s - mean) / (unbiased std + eps),
    'dr_grpo' s - mean, 'rloo' s - mean of the others; over the group's valid samples, 0 for invalid samples
    and for a group with fewer than two valid samples."""
    out = torch.zeros(scores.numel(), dtype=torch.float64)
    for g in set(groups.tolist()):
        members = [i for i in range(scores.numel()) if int(groups[i]) == g and bool(valid[i])]
        if len(members) < 2:
            continue
        s = [float(scores[i]) for i in members]
        mean = sum(s) / len(s)
        std = math.sqrt(sum((x - mean) ** 2 for x in s) / (len(s) - 1))
        for i, x in zip(members, s, strict=True):
            if kind == "grpo":
                out[i] = (x - mean) / (std + A.GRPO_STD_EPS)
            elif kind == "dr_grpo":
                out[i] = x - mean
            else:
                out[i] = x - (sum(s) - x) / (len(s) - 1)
    return out


@pytest.mark.parametrize("seed", range(5))
def test_group_estimators_equal_a_loop_over_the_groups(seed: int) -> None:
    """Random group ids (unsorted, sparse), invalid samples with NaN scores (a failed reward), singleton
    groups and groups whose only other member is invalid, ties (a zero-std group)."""
    g = torch.Generator().manual_seed(seed)
    n = 200
    groups = torch.randint(0, 60, (n,), generator=g) * 7 - 100  # ids need not be 0..k-1
    groups[:5] = torch.tensor([9001, 9002, 9003, 9003, 9004])  # singletons, and a pair ...
    scores = torch.randn(n, generator=g) * 3.0
    scores[10:] = torch.where(torch.rand(n - 10, generator=g) < 0.3, scores[10:].round(), scores[10:])
    valid = torch.rand(n, generator=g) > 0.2
    valid[2] = False  # ... one of whose members is invalid
    valid[3] = True
    scores = torch.where(valid, scores, torch.full_like(scores, math.nan))
    lens = torch.randint(0, 6, (n,), generator=g).tolist()
    for kind, got in (
        ("grpo", A.grpo(scores, groups, lens, valid).advantages),
        ("dr_grpo", A.grpo(scores, groups, lens, valid, scale=False).advantages),
        ("rloo", A.rloo(scores, groups, lens, valid).advantages),
    ):
        ref = _loop_group_scores(scores, groups, valid, kind)
        assert [int(a.numel()) for a in got] == lens
        per_sample = torch.tensor([float(a[0]) if a.numel() else float(ref[i]) for i, a in enumerate(got)])
        assert all(bool((a == a[0]).all()) for a in got if a.numel())  # one value over the sample's tokens
        assert bool(torch.isfinite(per_sample).all()), kind
        assert float((per_sample.double() - ref).abs().max()) <= 1e-5 * max(1.0, float(ref.abs().max())), kind
        assert bool((per_sample[~valid] == 0).all()) and bool((per_sample[:3] == 0).all()), kind
    direct = A.group_normalised_scores(scores, groups, valid)
    assert direct.dtype == torch.float32 and direct.shape == scores.shape
    assert float((direct.double() - _loop_group_scores(scores, groups, valid, "grpo")).abs().max()) <= 1e-5


def test_informative_groups_with_a_short_last_group() -> None:
    scores = [1.0, 1.0, 1.0, 0.0, 2.0, 2.0, 2.0, 2.0, 3.0]  # groups of 4: the last has one score
    assert A.informative_groups(scores, 4) == [True, False, False]
    assert A.informative_groups([], 4) == []
    assert A.informative_groups([0.5, 0.5 + 1e-12, 0.5 + 2e-9], 3) == [True]
