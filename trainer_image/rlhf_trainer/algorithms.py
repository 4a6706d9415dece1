"""Advantage estimators (gae, grpo, reinforce_pp), KL estimators, PPO losses and the LR schedule.

Pure torch on per-sample lists of response-token tensors (packed, no padding). Knows nothing of Ray,
DeepSpeed or vLLM; every function here is unit-tested in tests/unit/test_trainer_algorithms.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

EPS = 1e-6


@dataclass
class Advantages:
    """Per-sample response-token advantages and returns (returns are only meaningful for gae)."""

    advantages: list[torch.Tensor]
    returns: list[torch.Tensor]


def kl_per_token(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k1") -> torch.Tensor:
    """KL(pi || ref) estimate per token: k1 = log(pi/ref); k3 = ratio - 1 - log ratio (>= 0, low variance)."""
    log_ratio = logprobs - ref_logprobs
    if kind == "k1":
        return log_ratio
    if kind == "k3":
        neg = -log_ratio.clamp(-20.0, 20.0)
        return neg.exp() - 1.0 - neg
    raise ValueError(f"unknown KL estimator {kind!r}")


def token_rewards(score: float, kl: torch.Tensor, kl_coef: float) -> torch.Tensor:
    """Reward per response token: -kl_coef * kl_t everywhere, plus the sequence score at the last token."""
    r = -kl_coef * kl
    if r.numel():
        r = r.clone()
        r[-1] += score
    return r


def gae(
    rewards: Sequence[torch.Tensor], values: Sequence[torch.Tensor], gamma: float, lam: float
) -> Advantages:
    """Generalised advantage estimation per sample; values[t] is V of the state before token t."""
    advs, rets = [], []
    for r, v in zip(rewards, values, strict=True):
        n = r.numel()
        adv = torch.zeros(n, dtype=torch.float32)
        last = 0.0
        for t in range(n - 1, -1, -1):
            next_v = float(v[t + 1]) if t + 1 < n else 0.0
            delta = float(r[t]) + gamma * next_v - float(v[t])
            last = delta + gamma * lam * last
            adv[t] = last
        advs.append(adv)
        rets.append(adv + v.float())
    return Advantages(advs, rets)


def group_normalised_scores(
    scores: torch.Tensor, groups: torch.Tensor, valid: torch.Tensor | None = None, scale: bool = True
) -> torch.Tensor:
    """(score - group mean) / (group std + eps) per sample; invalid samples get 0 and don't count."""
    valid = torch.ones_like(scores, dtype=torch.bool) if valid is None else valid
    out = torch.zeros_like(scores, dtype=torch.float32)
    for g in torch.unique(groups):
        idx = (groups == g) & valid
        if not bool(idx.any()):
            continue
        s = scores[idx].float()
        centred = s - s.mean()
        if scale:
            std = s.std(unbiased=False) if s.numel() > 1 else torch.tensor(0.0)
            centred = centred / (std + EPS)
        out[idx] = centred
    return out


def grpo(
    scores: torch.Tensor,
    groups: torch.Tensor,
    response_lens: Sequence[int],
    valid: torch.Tensor | None = None,
) -> Advantages:
    """Group-relative advantages: the normalised score broadcast over the sample's tokens."""
    a = group_normalised_scores(scores, groups, valid)
    advs = [torch.full((int(n),), float(a[i])) for i, n in enumerate(response_lens)]
    return Advantages(advs, [torch.zeros_like(x) for x in advs])


def reinforce_pp(
    scores: torch.Tensor,
    groups: torch.Tensor,
    kls: Sequence[torch.Tensor],
    kl_coef: float,
    gamma: float,
    valid: torch.Tensor | None = None,
) -> Advantages:
    """REINFORCE++ (group-baseline variant): returns-to-go of (score - group mean) with a per-token KL
    penalty, then whitened over every valid token of the batch."""
    baseline = group_normalised_scores(scores, groups, valid, scale=False)
    valid = torch.ones_like(scores, dtype=torch.bool) if valid is None else valid
    rets = []
    for i, kl in enumerate(kls):
        r = token_rewards(float(baseline[i]), kl, kl_coef)
        g = torch.zeros_like(r)
        running = 0.0
        for t in range(r.numel() - 1, -1, -1):
            running = float(r[t]) + gamma * running
            g[t] = running
        rets.append(g)
    advs = whiten(rets, valid)
    return Advantages(advs, [torch.zeros_like(x) for x in advs])


def whiten(values: Sequence[torch.Tensor], valid: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Normalise to mean 0 / std 1 over all tokens of valid samples; invalid samples become zeros."""
    keep = [v for i, v in enumerate(values) if valid is None or bool(valid[i])]
    if not keep or sum(v.numel() for v in keep) == 0:
        return [torch.zeros_like(v) for v in values]
    cat = torch.cat(keep)
    mean, std = cat.mean(), cat.std(unbiased=False)
    return [
        ((v - mean) / (std + EPS)) if valid is None or bool(valid[i]) else torch.zeros_like(v)
        for i, v in enumerate(values)
    ]


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate summed over masked tokens (caller normalises); also the clip fraction sum."""
    ratio = (logprobs - old_logprobs).exp()
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip, 1.0 + clip) * advantages
    loss = -torch.minimum(unclipped, clipped)
    clipped_frac = ((ratio - 1.0).abs() > clip).float()
    return (loss * mask).sum(), (clipped_frac * mask).sum()


def value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, clip: float
) -> torch.Tensor:
    """Clipped value loss (0.5 * max of squared errors), summed over masked tokens."""
    v_clipped = old_values + (values - old_values).clamp(-clip, clip)
    loss = 0.5 * torch.maximum((values - returns) ** 2, (v_clipped - returns) ** 2)
    return (loss * mask).sum()


def lr_lambda(schedule: str, warmup_steps: int, total_steps: int) -> Callable[[int], float]:
    """Multiplier of the base LR at optimizer step s: linear warmup, then constant, cosine or linear decay."""

    def f(step: int) -> float:
        if warmup_steps and step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        span = max(1, total_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / span)
        if schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        if schedule == "linear":
            return 1.0 - progress
        raise ValueError(f"unknown lr schedule {schedule!r}")

    return f
