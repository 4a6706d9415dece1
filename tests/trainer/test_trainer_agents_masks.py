"""Tool tokens train nothing (issue 37 item 4): a trajectory's loss mask, laid out by agents.samples as the
trainer's loss reads it, gives every tool token exactly zero gradient and no place in the loss normaliser,
through the real forward (deepspeed_utils.response_logprobs on the tiny Llama) and the real losses
(algorithms.ppo_tokens / gspo_tokens, kl_per_token, aggregate_loss, loss_normaliser), every aggregation."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from rlhf_trainer import algorithms
from rlhf_trainer.agents.contract import Trajectory
from rlhf_trainer.agents.samples import loss_mask_at, pack_trajectories
from rlhf_trainer.workers import deepspeed_utils as du

pytestmark = pytest.mark.unit

# three episodes: model turn, tool output, model turn (and a single-turn one); masks 1 model / 0 tool
SHAPES = [([1, 1, 1, 0, 0, 0, 0, 1, 1]), ([1, 1, 0, 0, 1, 1, 1, 0, 1]), ([1, 1, 1, 1])]


def _trajectories(vocab: int) -> list[Trajectory]:
    g = torch.Generator().manual_seed(3)
    out = []
    for k, mask in enumerate(SHAPES):
        prompt = torch.randint(3, vocab, (4 + k,), generator=g).tolist()
        ids = torch.randint(3, vocab, (len(mask),), generator=g).tolist()
        lps = [-0.5 if m else 0.0 for m in mask]
        out.append(Trajectory(prompt, ids, list(mask), lps, turns=2))
    return out


def _loss(
    model: Any, at_tools: float, policy: str, mode: str, with_loss_mask: bool = True
) -> tuple[torch.Tensor, torch.Tensor, float, torch.Tensor]:
    """(lp's gradient [B, T-1], the loss mask [B, T-1], the normaliser, the parameters' gradient, flat).
    `at_tools`: the advantage at tool positions (and how far their old and reference log-probs are moved)."""
    model.zero_grad(set_to_none=True)
    rollout, loss_mask = pack_trajectories(_trajectories(int(model.config.vocab_size)), [0, 0, 1])
    out = du.response_logprobs(model, rollout, 0, rollout.num_samples, pad_id=0)
    lp, act = out.values, out.mask
    lp.retain_grad()
    valid = torch.ones(rollout.num_samples)
    mask = act * valid.unsqueeze(1) * (loss_mask_at(loss_mask, act) if with_loss_mask else 1.0)
    g = torch.Generator().manual_seed(7)
    n = int(rollout.response_lens.sum())
    now = out.packed()  # near the current policy, so no clip or clamp cuts a model token's gradient
    adv = torch.randn(n, generator=g)
    old = now + 0.02 * torch.randn(n, generator=g)
    ref = old - 0.05 * torch.randn(n, generator=g).abs()
    tool = loss_mask == 0  # whatever the tool positions hold must not matter
    adv[tool] = at_tools
    old[tool] = now[tool] - 0.01 * at_tools
    ref[tool] = now[tool] - 0.02 * at_tools
    adv_l, old_l, ref_l = out.local(adv), out.local(old), out.local(ref)
    if policy == "gspo":
        tok = algorithms.gspo_tokens(lp, old_l, adv_l, mask, 0.2, 0.28).loss
    else:
        tok = algorithms.ppo_tokens(lp, old_l, adv_l, 0.2, 0.28, dual_clip=3.0).loss
    norm = algorithms.loss_normaliser(mask, mode)
    loss = algorithms.aggregate_loss(tok, mask, mode, norm, norm_constant=16.0)
    loss = loss + 0.1 * algorithms.aggregate_loss(algorithms.kl_per_token(lp, ref_l, "k3"), mask, mode, norm)
    assert out.entropy is not None
    loss = loss - 0.01 * algorithms.aggregate_loss(out.entropy, mask, mode, norm)
    loss.backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    assert lp.grad is not None
    return lp.grad, loss_mask_at(loss_mask, act) * act, norm, grads


@pytest.mark.parametrize("policy", ["ppo", "gspo"])
@pytest.mark.parametrize("mode", algorithms.LOSS_AGGREGATIONS)
def test_tool_tokens_get_exactly_zero_gradient_and_no_share_of_the_normaliser(
    model: Any, policy: str, mode: str
) -> None:
    grad, mask, norm, params = _loss(model, 0.3, policy, mode)
    model_positions = mask > 0
    rollout, _ = pack_trajectories(_trajectories(int(model.config.vocab_size)), [0, 0, 1])
    _, _, act = du.pad_micro_batch(rollout, 0, rollout.num_samples, 0)
    tool_positions = act.bool() & ~model_positions
    assert int(tool_positions.sum()) == sum(len(s) - sum(s) for s in SHAPES) == 7
    assert torch.all(grad[tool_positions] == 0.0), "a tool token got a gradient"
    assert bool((grad[model_positions] != 0).all()), "a model token got no gradient"
    model_tokens = sum(sum(s) for s in SHAPES)
    assert norm == (model_tokens if mode == "token-mean" else len(SHAPES))
    # whatever the tool positions hold (advantages, old and reference log-probs), the update is the same
    _, _, _, params_other = _loss(model, -2.0, policy, mode)
    assert torch.equal(params, params_other), "tool positions' values changed the parameters' gradient"


def test_without_the_loss_mask_tool_tokens_would_be_trained(model: Any) -> None:
    """Today's policy loss masks by the action mask only (every response token): the wiring the loss mask
    needs is real, not a formality."""
    grad, mask, _, params = _loss(model, 0.3, "ppo", "token-mean", with_loss_mask=False)
    _, _, _, params_other = _loss(model, -2.0, "ppo", "token-mean", with_loss_mask=False)
    rollout, _ = pack_trajectories(_trajectories(int(model.config.vocab_size)), [0, 0, 1])
    _, _, act = du.pad_micro_batch(rollout, 0, rollout.num_samples, 0)
    assert bool((grad[act.bool() & (mask == 0)] != 0).any())
    assert not torch.equal(params, params_other)
