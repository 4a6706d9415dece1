"""Advantage estimators, KL and losses (rlhf_trainer.algorithms): pure torch, no Ray."""

from __future__ import annotations

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
    assert a[0] == pytest.approx(1.0, abs=1e-4) and a[1] == pytest.approx(-1.0, abs=1e-4)
    assert a[2] == 0.0 and a[3] == 0.0  # equal scores: no signal
    assert torch.equal(out.advantages[4], torch.zeros(4))  # invalid sample never trained on
    assert [x.numel() for x in out.advantages] == [2, 3, 1, 1, 4]


def test_reinforce_pp_returns_to_go_whitened() -> None:
    scores = torch.tensor([1.0, 0.0])
    groups = torch.tensor([0, 0])
    kls = [torch.zeros(3), torch.zeros(2)]
    out = A.reinforce_pp(scores, groups, kls, kl_coef=0.1, gamma=1.0)
    cat = torch.cat(out.advantages)
    assert float(cat.mean()) == pytest.approx(0.0, abs=1e-5)
    assert float(cat.std(unbiased=False)) == pytest.approx(1.0, abs=1e-3)
    assert bool((out.advantages[0] > 0).all()) and bool((out.advantages[1] < 0).all())


def test_token_rewards_put_score_on_last_token() -> None:
    r = A.token_rewards(2.0, torch.tensor([0.1, 0.2]), kl_coef=0.5)
    assert torch.allclose(r, torch.tensor([-0.05, 2.0 - 0.1]))


def test_kl_estimators() -> None:
    lp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.0, -1.0])
    assert torch.allclose(A.kl_per_token(lp, ref, "k1"), torch.tensor([0.0, -1.0]))
    k3 = A.kl_per_token(lp, ref, "k3")
    assert float(k3[0]) == 0.0 and float(k3[1]) > 0


def test_policy_loss_clips() -> None:
    old = torch.zeros(1, 2)
    lp = torch.log(torch.tensor([[2.0, 0.5]]))
    adv = torch.ones(1, 2)
    mask = torch.ones(1, 2)
    loss, clipped = A.policy_loss(lp, old, adv, mask, clip=0.2)
    assert float(loss) == pytest.approx(-(1.2 + 0.5))
    assert float(clipped) == 2.0


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
