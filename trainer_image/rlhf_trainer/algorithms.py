"""Advantage estimators (gae, grpo, rloo, reinforce_pp), KL estimators and the adaptive KL controller, PPO and
GSPO losses with clip-higher and dual clip, rollout importance weights, the nucleus-renormalised log-probs,
reward shaping (clip, running normalisation, overlong), loss aggregation, LR schedule.

Pure torch on per-sample lists of response-token tensors (packed, no padding). Knows nothing of Ray,
DeepSpeed or vLLM: where a number must cover every data-parallel rank (a token count, whitening moments)
the function takes it as an argument and the workers all-reduce it. Unit-tested in
tests/trainer/test_trainer_algorithms.py and, against the papers' equations, test_objectives_reference.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.utils.checkpoint

EPS = 1e-6
# GRPO: (score - group mean) / (unbiased group std + GRPO_STD_EPS), verl's estimator and epsilon
# (TRL: unbiased std + 1e-4; OpenRLHF: unbiased std + 1e-9).
GRPO_STD_EPS = 1e-6
# exp() of a log-ratio is taken after clamping it to +-LOG_RATIO_CLAMP (OpenRLHF and verl use 20): a stale
# or diverged token then gives a large finite ratio instead of inf (and NaN gradients).
LOG_RATIO_CLAMP = 20.0
# The k3 KL estimate is clamped to +-K3_CLAMP, as verl's "low_var_kl" does.
K3_CLAMP = 10.0
# The float32 log-softmax over the vocabulary runs over at most this many bytes of rows at a time
# (chunked_token_logprobs): 64 MiB is 512 positions at a 32k vocabulary, 128 at 128k. A chunk's transient
# intermediates are several such tensors (temperature, log-softmax, entropy; top-p adds a sort's values and
# int64 indices, a softmax and a cumsum), and under a gradient its recomputation runs on top of the backward's
# buffers, so the chunk must be small against the micro-batch's responses: measured (8 x 384 responses, 32k,
# top-p 0.9, CPU) the fwd+bwd peak was 1.65 GiB at 64 MiB, 2.8 GiB at 256 MiB (no better than not
# checkpointing), 4.6 GiB unchunked. Each chunk is still 16M+ elements, so per-chunk overhead is negligible.
LOGPROB_CHUNK_BYTES = 64 * 2**20
LOSS_AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
# The adaptive KL controller moves the coefficient by at most this proportional error per update (Ziegler et al.)
KL_ERROR_CLIP = 0.2


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
    """Generalised advantage estimation per sample; values[t] is V of the state before token t (V after
    the last token is 0). Every sample at once: one backward pass over the longest response, each
    position a vector operation over the batch (right padding adds nothing: its rewards and values are 0)."""
    r = _right_padded(rewards)
    v = _right_padded(values)
    next_v = torch.cat([v[:, 1:], torch.zeros_like(v[:, :1])], dim=1)
    deltas = r + gamma * next_v - v
    adv = _backward_discount(deltas, gamma * lam)
    advs = _unpad(adv, rewards)
    return Advantages(advs, [a + x.float() for a, x in zip(advs, values, strict=True)])


def _right_padded(xs: Sequence[torch.Tensor]) -> torch.Tensor:
    width = max((int(x.numel()) for x in xs), default=0)
    out = torch.zeros(len(xs), width, dtype=torch.float64)
    for i, x in enumerate(xs):
        out[i, : x.numel()] = x.double()
    return out


def _unpad(padded: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [padded[i, : x.numel()].float() for i, x in enumerate(like)]


def _backward_discount(x: torch.Tensor, factor: float) -> torch.Tensor:
    """out[:, t] = sum_l factor^l x[:, t + l], one vector step per position from the end."""
    out = torch.zeros_like(x)
    running = torch.zeros(x.shape[0], dtype=x.dtype)
    for t in range(x.shape[1] - 1, -1, -1):
        running = x[:, t] + factor * running
        out[:, t] = running
    return out


def _group_centred(
    scores: torch.Tensor, groups: torch.Tensor, valid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per sample, over its group's valid samples: (score - group mean, the group's valid count, the group
    index), float64. One scatter pass per moment instead of a Python loop over the groups; invalid samples
    get 0 and add nothing (their scores may be NaN: a failed reward), so nothing leaks into a group."""
    _, inv = torch.unique(groups, return_inverse=True)
    k = int(inv.max()) + 1 if inv.numel() else 0
    s = torch.where(valid, scores.double(), torch.zeros((), dtype=torch.float64))
    count = torch.zeros(k, dtype=torch.float64).index_add_(0, inv, valid.double())
    mean = torch.zeros(k, dtype=torch.float64).index_add_(0, inv, s) / count.clamp(min=1.0)
    centred = torch.where(valid, s - mean[inv], torch.zeros((), dtype=torch.float64))
    return centred, count[inv], inv


def group_normalised_scores(
    scores: torch.Tensor, groups: torch.Tensor, valid: torch.Tensor | None = None, scale: bool = True
) -> torch.Tensor:
    """(score - group mean) / (unbiased group std + GRPO_STD_EPS) per sample, over the group's valid samples;
    invalid samples get 0 and don't count, and a group with a single valid sample gets 0 (no baseline).
    Vectorised over the groups (float64 moments, float32 result)."""
    valid = torch.ones_like(scores, dtype=torch.bool) if valid is None else valid.bool()
    centred, n, inv = _group_centred(scores, groups, valid)
    if scale:
        sq = torch.zeros_like(centred).index_add_(0, inv, centred.square())  # rows: groups (<= samples)
        std = (sq[inv] / (n - 1.0).clamp(min=1.0)).sqrt()
        centred = centred / (std + GRPO_STD_EPS)
    return centred.float()  # a single valid sample is its own mean: exactly 0, scaled or not


def grpo(
    scores: torch.Tensor,
    groups: torch.Tensor,
    response_lens: Sequence[int],
    valid: torch.Tensor | None = None,
    scale: bool = True,
) -> Advantages:
    """Group-relative advantages: the normalised score broadcast over the sample's tokens. `scale` False is
    Dr. GRPO's (score - group mean, no division by the group's std)."""
    return _broadcast(group_normalised_scores(scores, groups, valid, scale), response_lens)


def rloo(
    scores: torch.Tensor,
    groups: torch.Tensor,
    response_lens: Sequence[int],
    valid: torch.Tensor | None = None,
) -> Advantages:
    """REINFORCE leave-one-out (Ahmadian et al. 2024): score minus the mean of the other valid samples of its
    group, broadcast over the sample's tokens; n/(n-1) times (score - group mean). A group with one valid
    sample has no baseline and gets 0; invalid samples get 0. No whitening."""
    valid = torch.ones_like(scores, dtype=torch.bool) if valid is None else valid.bool()
    centred, n, _ = _group_centred(scores, groups, valid)
    # a single valid sample is its own mean (centred exactly 0): the clamp only avoids 0/0
    return _broadcast((centred * n / (n - 1.0).clamp(min=1.0)).float(), response_lens)


def _broadcast(per_sample: torch.Tensor, response_lens: Sequence[int]) -> Advantages:
    """Each sample's value over its response tokens: one repeat and one split (the tensors are views of one
    buffer; every caller concatenates or reads them), not a tensor built per sample."""
    lens = [int(n) for n in response_lens]
    flat = torch.repeat_interleave(per_sample.detach().float().cpu(), torch.tensor(lens, dtype=torch.long))
    return Advantages(list(torch.split(flat, lens)), list(torch.split(torch.zeros_like(flat), lens)))


def reinforce_pp(
    scores: torch.Tensor,
    groups: torch.Tensor,
    kls: Sequence[torch.Tensor],
    kl_coef: float,
    gamma: float,
    valid: torch.Tensor | None = None,
    baseline: bool = False,
) -> Advantages:
    """REINFORCE++ (Hu 2025): returns-to-go of the per-token KL penalty plus the score on the last token
    (`baseline`: score minus its group's mean, OpenRLHF's reinforce++_baseline), whitened over every valid
    token given (one rank's shard: for the whole batch, whiten reinforce_pp_returns with all-reduced
    whitening_moments)."""
    valid = torch.ones_like(scores, dtype=torch.bool) if valid is None else valid
    advs = whiten(reinforce_pp_returns(scores, groups, kls, kl_coef, gamma, valid, baseline), valid)
    return Advantages(advs, [torch.zeros_like(x) for x in advs])


def reinforce_pp_returns(
    scores: torch.Tensor,
    groups: torch.Tensor,
    kls: Sequence[torch.Tensor],
    kl_coef: float,
    gamma: float,
    valid: torch.Tensor | None = None,
    baseline: bool = False,
) -> list[torch.Tensor]:
    """REINFORCE++ returns-to-go per token, before whitening: sum_l gamma^l r_(t+l), where r_t is
    -kl_coef * kl_t plus the score (`baseline`: minus its group's mean) on the last token."""
    final = group_normalised_scores(scores, groups, valid, scale=False) if baseline else scores.float()
    return discounted_returns(
        [token_rewards(float(final[i]), kl, kl_coef) for i, kl in enumerate(kls)], gamma
    )


def discounted_returns(rewards: Sequence[torch.Tensor], gamma: float) -> list[torch.Tensor]:
    """sum_l gamma^l r_(t+l) for every t of every sample: one backward pass over the batch, a vector
    operation per position (linear in the response length, unlike a matrix of discounts)."""
    return _unpad(_backward_discount(_right_padded(rewards), gamma), rewards)


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


@dataclass
class TokenLoss:
    """A policy loss per token, and where its clips bind (1.0 / 0.0 per token)."""

    loss: torch.Tensor
    clipped: torch.Tensor  # the ratio clip is the term taken, and it differs from the unclipped one
    dual_clipped: torch.Tensor  # A < 0 and the loss is capped at -dual_clip * A


def ppo_tokens(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float,
    clip_high: float | None = None,
    dual_clip: float | None = None,
) -> TokenLoss:
    """PPO's clipped surrogate per token, max(-r A, -clip(r, 1 - clip_low, 1 + clip_high) A) with
    r = exp(log-ratio clamped to +-LOG_RATIO_CLAMP); clip_high above clip_low is DAPO's clip-higher. With
    `dual_clip` c (> 1, Ye et al. 2020) a negative advantage's loss is also capped at -c A, so a ratio far
    above 1 cannot make it unbounded over several epochs, mini-batches or async steps."""
    ratio = (logprobs - old_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    high = clip_low if clip_high is None else clip_high
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + high)
    loss = torch.maximum(unclipped, clipped)
    binds = (clipped > unclipped).float()
    dual = torch.zeros_like(loss)
    if dual_clip is not None:
        cap = -advantages * dual_clip
        capped = (advantages < 0) & (cap < loss)
        loss = torch.where(capped, cap, loss)
        dual = capped.float()
    return TokenLoss(loss, binds, dual)


def gspo_tokens(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float | None = None,
) -> TokenLoss:
    """GSPO (Zheng et al. 2025) on a (sequences x tokens) batch: the importance ratio is the sequence's
    length-normalised likelihood ratio s_i = exp(mean_t log-ratio), clipped per sequence. The token-level
    form: log s_it = sg(log s_i) + log pi_t - sg(log pi_t), whose value is s_i and whose gradient flows
    through each token's log-prob. Needs whole rows (no sequence parallelism)."""
    mask = mask.to(logprobs.dtype)
    log_ratio = (logprobs - old_logprobs) * mask
    seq = log_ratio.sum(-1) / mask.sum(-1).clamp(min=1.0)
    log_s = seq.detach().unsqueeze(-1) + logprobs - logprobs.detach()
    ratio = log_s.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    high = clip_low if clip_high is None else clip_high
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + high)
    loss = torch.maximum(unclipped, clipped)
    return TokenLoss(loss, (clipped > unclipped).float(), torch.zeros_like(loss))


def policy_loss_tokens(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, clip: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The symmetric PPO surrogate per token (ppo_tokens), and 1.0 where its clip binds."""
    out = ppo_tokens(logprobs, old_logprobs, advantages, clip)
    return out.loss, out.clipped


ROLLOUT_IS_LEVELS = ("token", "sequence")
ROLLOUT_IS_MODES = ("truncate", "mask")


def rollout_weights(
    proximal: torch.Tensor,
    behaviour: torch.Tensor,
    mask: torch.Tensor,
    level: str,
    mode: str,
    lower: float,
    upper: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Importance weights pi_prox / pi_behav of sampled tokens on a (sequences x tokens) batch, and the
    mask of tokens kept: pi_behav is the engine's log-prob (vLLM's kernels, possibly older weights),
    pi_prox the trainer's before this update. `token`: one weight per token; `sequence`: the product over
    the row's tokens. `truncate` clamps the weight into [lower, upper] and keeps every token (truncated
    IS); `mask` drops the tokens (or whole rows) whose weight is outside it (masked IS, AReaL's decoupled
    PPO). Detached: a weight scales the loss, it is not trained through."""
    if level not in ROLLOUT_IS_LEVELS:
        raise ValueError(f"unknown rollout correction level {level!r} (token or sequence)")
    if mode not in ROLLOUT_IS_MODES:
        raise ValueError(f"unknown rollout correction mode {mode!r} (truncate or mask)")
    log_w = (proximal - behaviour).detach() * mask
    if level == "sequence":
        log_w = log_w.sum(-1, keepdim=True).expand_as(proximal)
    weight = log_w.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    if mode == "truncate":
        return weight.clamp(lower, upper), torch.ones_like(weight)
    kept = ((weight >= lower) & (weight <= upper)).to(weight.dtype)
    return weight * kept, kept


def top_p_logits(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """`logits` with the tokens outside the nucleus at -inf, by vLLM's rule (its sampler's and its
    processed log-probs'): sorted ascending, a token is dropped while the probability mass up to and
    including it is at most 1 - top_p; the most likely token is always kept."""
    if top_p >= 1.0:
        return logits
    ordered, order = logits.sort(dim=-1, descending=False)
    mass = ordered.softmax(dim=-1).cumsum(dim=-1)
    drop = mass <= 1.0 - top_p
    drop[..., -1] = False
    drop = drop.scatter(-1, order, drop)
    return logits.masked_fill(drop, float("-inf"))


def token_logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    top_p: float = 1.0,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of `labels` and the entropy per position, under the distribution the engines sample from:
    logits / temperature, renormalised over the top-p nucleus. vLLM's processed log-probs are taken over
    that same distribution, so on identical weights the ratio of the two is 1 whatever top_p is. The
    entropy is detached unless `entropy_grad` (an entropy bonus trains through it): a vocabulary-sized
    intermediate is then not kept for the backward pass."""
    if temperature != 1.0:
        logits = logits / temperature
    kept = top_p_logits(logits, top_p)
    if top_p < 1.0:  # the sampled token was in the engine's nucleus: never drop it on a rounding difference
        at = labels.unsqueeze(-1)
        kept = kept.scatter(-1, at, logits.gather(-1, at))
    logp = torch.log_softmax(kept, dim=-1)
    lp = logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        src = logp if entropy_grad else logp.detach()
        p = src.exp()
        entropy = -(p * torch.where(p > 0, src, torch.zeros_like(src))).sum(-1)
    return lp, entropy


def logprob_chunk_rows(vocab: int) -> int:
    """Positions per chunk of the float32 log-softmax: LOGPROB_CHUNK_BYTES of float32 rows of `vocab`."""
    return max(1, LOGPROB_CHUNK_BYTES // (4 * max(vocab, 1)))


def chunked_token_logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    top_p: float = 1.0,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """token_logprobs over logits [R, V] (any float dtype) and labels [R], logprob_chunk_rows(V) positions at
    a time, so the float32 intermediates are [chunk, V], never [R, V]. With a gradient and more than one
    chunk each chunk is checkpointed: the backward keeps only the chunk's input logits (already alive in
    the caller) and recomputes its float32 log-softmax, instead of keeping it (and top-p's sort) for every
    chunk; a single chunk is kept as it is (within the budget, and no second top-p sort)."""
    rows = logprob_chunk_rows(int(logits.shape[-1]))
    grad = torch.is_grad_enabled() and logits.requires_grad

    def chunk(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return token_logprobs(x.float(), y, temperature, top_p, entropy_grad)

    lps, ents = [], []
    # split() gives one empty chunk when R is 0: the outputs still hang off `logits` in the graph, so a rank
    # with no response positions (under SP, all its columns in the prompts) still runs the backward
    chunks = list(zip(torch.split(logits, rows), torch.split(labels, rows), strict=True))
    recompute = grad and len(chunks) > 1  # one chunk is within the budget kept: a recompute saves nothing
    for x, y in chunks:
        if recompute:
            lp, ent = torch.utils.checkpoint.checkpoint(chunk, x, y, use_reentrant=False)
        else:
            lp, ent = chunk(x, y)
        lps.append(lp)
        ents.append(ent)
    return torch.cat(lps), torch.cat(ents)


def logprob_mismatch(
    trainer_lp: torch.Tensor, engine_lp: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """The train-inference gap over sampled tokens: mean signed log-ratio (trainer - engine), and the 99th
    percentile and maximum of its magnitude."""
    sel = mask > 0
    if not bool(sel.any()):
        return {"mean": 0.0, "p99": 0.0, "max": 0.0}
    diff = (trainer_lp.detach() - engine_lp.detach())[sel].double()
    mag = diff.abs()
    return {"mean": float(diff.mean()), "p99": float(torch.quantile(mag, 0.99)), "max": float(mag.max())}


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
    norm_constant: float = 1.0,
) -> torch.Tensor:
    """Reduce a (sequences x tokens) loss to a scalar, verl's modes:
    - token-mean: sum of masked token losses / number of masked tokens;
    - seq-mean-token-mean: mean over sequences of each sequence's masked-token mean;
    - seq-mean-token-sum: mean over sequences of each sequence's masked-token sum;
    - seq-mean-token-sum-norm: that divided by the constant `norm_constant` (Dr. GRPO: the maximum
      response length), so no sample's tokens weigh more for its being short.
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
        if mode == "seq-mean-token-sum-norm":
            total = total / norm_constant
    return total / max(denom, 1.0)


@dataclass
class AdaptiveKL:
    """Ziegler et al. (2019)'s adaptive KL coefficient: after each step, coef *= 1 + e * n / horizon with
    e = clip(KL / target - 1, +-KL_ERROR_CLIP) and n the step's samples, so the KL tracks `target`."""

    coef: float
    target: float
    horizon: int

    def update(self, kl: float, n_steps: int) -> float:
        error = min(max(kl / self.target - 1.0, -KL_ERROR_CLIP), KL_ERROR_CLIP)
        self.coef *= 1.0 + error * n_steps / self.horizon
        return self.coef


def clip_scores(scores: torch.Tensor, bound: float | None) -> torch.Tensor:
    """Scores clamped into [-bound, bound] (None: unchanged)."""
    return scores if bound is None else scores.clamp(-bound, bound)


def overlong_penalty(response_lens: torch.Tensor, max_len: int, buffer: int, factor: float) -> torch.Tensor:
    """DAPO's soft overlong punishment per sample: 0 up to max_len - buffer tokens, then falling linearly to
    -factor at max_len (and -factor beyond)."""
    lens = response_lens.to(torch.float32)
    start = float(max_len - buffer)
    ramp = (start - lens) / float(buffer) * factor
    return torch.where(lens <= start, torch.zeros_like(lens), torch.clamp(ramp, min=-factor))


@dataclass
class RunningMoments:
    """Mean and (population) variance of every score seen so far, for running reward normalisation;
    merged batch by batch (Chan et al.'s parallel update), checkpointed with the step history."""

    count: float = 0.0
    mean: float = 0.0
    m2: float = 0.0

    def merged(self, batch: torch.Tensor) -> RunningMoments:
        """These moments with a batch's (sum, sum of squares, count), as whitening_moments gives."""
        total, total_sq, n = (float(x) for x in batch)
        if n <= 0:
            return RunningMoments(self.count, self.mean, self.m2)
        b_mean = total / n
        b_m2 = max(total_sq - n * b_mean * b_mean, 0.0)
        count = self.count + n
        delta = b_mean - self.mean
        mean = self.mean + delta * n / count
        m2 = self.m2 + b_m2 + delta * delta * self.count * n / count
        return RunningMoments(count, mean, m2)

    @property
    def std(self) -> float:
        return math.sqrt(self.m2 / self.count) if self.count > 0 else 0.0


def normalise_scores(scores: torch.Tensor, moments: RunningMoments) -> torch.Tensor:
    """(score - running mean) / (running std + EPS)."""
    return (scores.float() - moments.mean) / (moments.std + EPS)


def informative_groups(scores: Sequence[float], group_size: int, tol: float = 1e-9) -> list[bool]:
    """Per consecutive group of `group_size` scores: whether its rewards differ (DAPO's dynamic sampling
    keeps only these; a group whose rewards are all equal has zero group-relative advantage). A Python loop on
    purpose: its input is a list, and a tensor version measured slower (0.14 against 0.09 ms for 128 groups
    of 8; 43 against 1 us for the one group dynamic_sampling passes)."""
    out = []
    for i in range(0, len(scores), group_size):
        g = scores[i : i + group_size]
        out.append(max(g) - min(g) > tol)
    return out


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
