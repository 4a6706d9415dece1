"""Advantage estimators (gae, grpo, reinforce_pp), KL estimators, PPO losses, loss aggregation, LR schedule.

Pure torch on per-sample lists of response-token tensors (packed, no padding). Knows nothing of Ray,
DeepSpeed or vLLM: where a number must cover every data-parallel rank (a token count, whitening moments)
the function takes it as an argument and the workers all-reduce it. Unit-tested in
tests/unit/test_trainer_algorithms.py and, against the papers' equations, test_objectives_reference.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

EPS = 1e-6
# GRPO: (score - group mean) / (unbiased group std + GRPO_STD_EPS), verl's estimator and epsilon
# (TRL: unbiased std + 1e-4; OpenRLHF: unbiased std + 1e-9).
GRPO_STD_EPS = 1e-6
# exp() of a log-ratio is taken after clamping it to +-LOG_RATIO_CLAMP (OpenRLHF and verl use 20): a stale
# or diverged token then gives a large finite ratio instead of inf (and NaN gradients).
LOG_RATIO_CLAMP = 20.0
# The k3 KL estimate is clamped to +-K3_CLAMP, as verl's "low_var_kl" does.
K3_CLAMP = 10.0
LOSS_AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


@dataclass
class Advantages:
    """Per-sample response-token advantages and returns (returns are only meaningful for gae)."""

    advantages: list[torch.Tensor]
    returns: list[torch.Tensor]


def kl_per_token(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k1") -> torch.Tensor:
    """KL(pi || ref) estimate per token (Schulman's estimators, x sampled from pi, r = ref(x) / pi(x)):
    k1 = -log r (unbiased); k2 = (log r)^2 / 2; k3 = r - 1 - log r (unbiased, >= 0, low variance), with
    log r clamped to +-LOG_RATIO_CLAMP before exp and the result clamped to +-K3_CLAMP."""
    log_ratio = logprobs - ref_logprobs
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    if kind == "k3":
        log_r = (-log_ratio).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        return (log_r.exp() - 1.0 - log_r).clamp(-K3_CLAMP, K3_CLAMP)
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
    """(score - group mean) / (unbiased group std + GRPO_STD_EPS) per sample, over the group's valid samples;
    invalid samples get 0 and don't count, and a group with a single valid sample gets 0 (no baseline)."""
    valid = torch.ones_like(scores, dtype=torch.bool) if valid is None else valid
    out = torch.zeros_like(scores, dtype=torch.float32)
    for g in torch.unique(groups):
        idx = (groups == g) & valid
        if not bool(idx.any()):
            continue
        s = scores[idx].float()
        centred = s - s.mean()
        if scale:
            std = s.std(unbiased=True) if s.numel() > 1 else torch.tensor(0.0)
            centred = centred / (std + GRPO_STD_EPS)
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
    penalty, then whitened over every valid token given (one rank's shard: for the whole batch, whiten
    reinforce_pp_returns with all-reduced whitening_moments)."""
    valid = torch.ones_like(scores, dtype=torch.bool) if valid is None else valid
    advs = whiten(reinforce_pp_returns(scores, groups, kls, kl_coef, gamma, valid), valid)
    return Advantages(advs, [torch.zeros_like(x) for x in advs])


def reinforce_pp_returns(
    scores: torch.Tensor,
    groups: torch.Tensor,
    kls: Sequence[torch.Tensor],
    kl_coef: float,
    gamma: float,
    valid: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """REINFORCE++ returns-to-go per token, before whitening: sum_l gamma^l r_(t+l), where r_t is
    -kl_coef * kl_t plus (score - group mean) on the last token."""
    baseline = group_normalised_scores(scores, groups, valid, scale=False)
    rets = []
    for i, kl in enumerate(kls):
        r = token_rewards(float(baseline[i]), kl, kl_coef)
        g = torch.zeros_like(r)
        running = 0.0
        for t in range(r.numel() - 1, -1, -1):
            running = float(r[t]) + gamma * running
            g[t] = running
        rets.append(g)
    return rets


def whitening_moments(values: Sequence[torch.Tensor], valid: torch.Tensor | None = None) -> torch.Tensor:
    """[sum, sum of squares, count] over all tokens of valid samples, float64: add these up over the
    data-parallel ranks (all-reduce SUM) and pass the total to whiten_with for batch-wide whitening."""
    out = torch.zeros(3, dtype=torch.float64)
    for i, v in enumerate(values):
        if valid is None or bool(valid[i]):
            x = v.detach().to(torch.float64)
            out += torch.stack(
                [x.sum(), x.square().sum(), torch.tensor(float(x.numel()), dtype=torch.float64)]
            )
    return out


def whiten_with(
    values: Sequence[torch.Tensor], moments: torch.Tensor, valid: torch.Tensor | None = None
) -> list[torch.Tensor]:
    """(v - mean) / (std + EPS) with mean and std from `moments` (whitening_moments, possibly summed over
    ranks); population (biased) std, as OpenRLHF (verl uses the unbiased one: a factor n/(n-1) in the
    variance, negligible at batch sizes of thousands of tokens). Invalid samples become zeros."""
    total, total_sq, count = (float(x) for x in moments)
    if count <= 0:
        return [torch.zeros_like(v) for v in values]
    mean = total / count
    std = math.sqrt(max(total_sq / count - mean * mean, 0.0))
    return [
        ((v - mean) / (std + EPS)).to(v.dtype) if valid is None or bool(valid[i]) else torch.zeros_like(v)
        for i, v in enumerate(values)
    ]


def whiten(values: Sequence[torch.Tensor], valid: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Normalise to mean 0 / std 1 over all tokens of valid samples given; invalid samples become zeros."""
    return whiten_with(values, whitening_moments(values, valid), valid)


def policy_loss_tokens(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, clip: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate per token, -min(r A, clip(r, 1 - clip, 1 + clip) A) with r = exp(log-ratio
    clamped to +-LOG_RATIO_CLAMP); also 1.0 where the ratio is outside the clip range, else 0.0."""
    ratio = (logprobs - old_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip, 1.0 + clip) * advantages
    loss = -torch.minimum(unclipped, clipped)
    return loss, ((ratio - 1.0).abs() > clip).float()


def behaviour_weights(
    proximal_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, correction: str, cap: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token importance weights pi_prox / pi_behav of samples generated by older weights, and the mask
    of tokens kept: `decoupled` (AReaL's decoupled PPO) drops tokens whose weight exceeds `cap`,
    `truncated` (truncated importance sampling) keeps every token with its weight clamped to `cap`.
    With samples from the proximal policy itself (staleness 0) every weight is exactly 1."""
    if correction not in ("decoupled", "truncated"):
        raise ValueError(f"unknown off-policy correction {correction!r} (decoupled or truncated)")
    weight = (proximal_logprobs - behaviour_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    if correction == "truncated":
        return weight.clamp(max=cap), torch.ones_like(weight)
    keep = (weight <= cap).float()
    return weight * keep, keep


def decoupled_policy_loss_tokens(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip: float,
    correction: str = "decoupled",
    cap: float = 5.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The off-policy PPO surrogate per token: the clipped ratio pi_theta / pi_prox (the trust region
    around the policy before this update), weighted by pi_prox / pi_behav (the engine's log-probs of the
    weights that generated the sample). Returns (loss, clipped, kept): `kept` masks tokens the decoupled
    correction drops. With behaviour = proximal it is `policy_loss_tokens` exactly."""
    loss, clipped = policy_loss_tokens(logprobs, proximal_logprobs, advantages, clip)
    weight, kept = behaviour_weights(proximal_logprobs, behaviour_logprobs, correction, cap)
    return loss * weight, clipped * kept, kept


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate summed over masked tokens (caller normalises); also the clip fraction sum."""
    loss, clipped = policy_loss_tokens(logprobs, old_logprobs, advantages, clip)
    return (loss * mask).sum(), (clipped * mask).sum()


def value_loss_tokens(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float
) -> torch.Tensor:
    """Clipped value loss per token: 0.5 * max((V - R)^2, (V_old + clip(V - V_old, +-clip) - R)^2)."""
    v_clipped = old_values + (values - old_values).clamp(-clip, clip)
    return 0.5 * torch.maximum((values - returns) ** 2, (v_clipped - returns) ** 2)


def value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, clip: float
) -> torch.Tensor:
    """Clipped value loss (0.5 * max of squared errors), summed over masked tokens."""
    return (value_loss_tokens(values, old_values, returns, clip) * mask).sum()


def _check_aggregation(mode: str) -> None:
    if mode not in LOSS_AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {mode!r}; expected one of {', '.join(LOSS_AGGREGATIONS)}")


def loss_normaliser(mask: torch.Tensor, mode: str, seq_tokens: torch.Tensor | None = None) -> float:
    """This micro-batch's share of the denominator of `mode`: its masked tokens (token-mean) or its
    sequences with at least one masked token (seq-mean-*). Add it up over micro-batches and ranks (an
    all-reduce) and pass the total to aggregate_loss. `seq_tokens`: see aggregate_loss."""
    _check_aggregation(mode)
    if mode == "token-mean":
        return float(mask.sum())
    counts = mask.sum(dim=-1) if seq_tokens is None else seq_tokens
    return float((counts > 0).sum())


def sample_normaliser(response_lens: torch.Tensor, valid: torch.Tensor, mode: str) -> float:
    """loss_normaliser from per-sample counts instead of a mask: the valid samples' response tokens
    (token-mean) or the valid samples with a response (seq-mean-*). The same on every rank of a sequence-
    parallel group, which holds all of its samples but only some columns of each."""
    _check_aggregation(mode)
    lens = response_lens.to(torch.int64)
    if mode == "token-mean":
        return float(lens[valid].sum())
    return float(((lens > 0) & valid).sum())


def aggregate_loss(
    token_loss: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    normaliser: float | None = None,
    seq_tokens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce a (sequences x tokens) loss to a scalar, verl's modes:
    - token-mean: sum of masked token losses / number of masked tokens;
    - seq-mean-token-mean: mean over sequences of each sequence's masked-token mean;
    - seq-mean-token-sum: mean over sequences of each sequence's masked-token sum.
    Sequences without a masked token (invalid, or all padding) count in no denominator. `normaliser`
    replaces this call's own count (loss_normaliser) by the total over every micro-batch and rank of the
    optimizer step, so the contributions add up to the global mean: no rank or micro-batch weighs more
    for having fewer tokens. `seq_tokens` gives each sequence's masked-token count when `mask` holds only
    a slice of its columns (sequence parallelism); default mask.sum(-1)."""
    _check_aggregation(mode)
    masked = token_loss * mask
    denom = loss_normaliser(mask, mode, seq_tokens) if normaliser is None else float(normaliser)
    if mode == "token-mean":
        total = masked.sum()
    else:
        per_seq = masked.sum(dim=-1)
        if mode == "seq-mean-token-mean":
            counts = (mask.sum(dim=-1) if seq_tokens is None else seq_tokens).to(per_seq.dtype)
            per_seq = torch.where(counts > 0, per_seq / counts.clamp(min=1.0), torch.zeros_like(per_seq))
        total = per_seq.sum()
    return total / max(denom, 1.0)


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
