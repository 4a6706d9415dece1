"""Advantages for the shards one actor rank holds, whitened over the whole batch.

Whitening (gae, reinforce_pp*) and running reward normalisation and the critic's explained variance need moments of every rank's tokens:
this module takes them through `reduce` (an all-reduce SUM over the actor ranks; the identity with one
rank), so one rank and N ranks give the same advantages for the same batch, as OpenRLHF and verl whiten
over everything. Ranks of one sequence-parallel group hold the same shards and add them up several
times; the moments are ratios of sums, which that scales alike. Pure torch; no Ray, no DeepSpeed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from rlhf_trainer import algorithms
from rlhf_trainer.transfer import split_per_response

Reduce = Callable[[torch.Tensor], torch.Tensor]
ZERO_ADVANTAGE = 1e-12  # |advantage| at or below this is no signal


def no_reduce(t: torch.Tensor) -> torch.Tensor:
    """The reduction of a single rank: nothing to add."""
    return t


@dataclass
class ShardInputs:
    """One shard's experience: per-sample scores and validity, per-token packed log-probs and values."""

    scores: torch.Tensor
    valid: torch.Tensor
    response_lens: torch.Tensor
    group: torch.Tensor
    # rollout.agent: 1.0 per model token, 0.0 per tool token (packed); None: every token the model's
    loss_mask: torch.Tensor | None = None
    old_logprobs: torch.Tensor | None = None  # None: skipped (config.old_logprobs_redundant)
    ref_logprobs: torch.Tensor | None = None
    values: torch.Tensor | None = None  # gae only


@dataclass
class ShardAdvantages:
    advantages: torch.Tensor  # packed per response token; 0 on invalid samples and on tool tokens
    returns: torch.Tensor | None  # gae only: the critic's targets (0 on tool tokens)


@dataclass(frozen=True)
class ModelTokens:
    """Where a shard's model tokens are among its response tokens (rollout.agent's loss mask). The
    estimators run on the model tokens alone, as if the tools' were not there: a tool's tokens carry no KL,
    no value and no reward, GAE's and REINFORCE++'s discounting steps over them, the score lands on the
    last model token, and whitening counts model tokens only; `expand` puts the results back in the
    response layout with 0 at every tool token. Without a mask both directions are the identity."""

    keep: list[torch.Tensor] | None  # per sample: indexes of its model tokens within its response

    @staticmethod
    def of(x: ShardInputs) -> ModelTokens:
        if x.loss_mask is None:
            return ModelTokens(None)
        per_sample = split_per_response(x.loss_mask, x.response_lens)
        return ModelTokens([m.nonzero().squeeze(1) for m in per_sample])

    def lens(self, response_lens: torch.Tensor) -> list[int]:
        if self.keep is None:
            return [int(n) for n in response_lens]
        return [int(k.numel()) for k in self.keep]

    def take(self, per_sample: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per-sample response-token values -> their model tokens' values."""
        if self.keep is None:
            return per_sample
        return [v[k] for v, k in zip(per_sample, self.keep, strict=True)]

    def expand(self, per_sample: list[torch.Tensor], response_lens: torch.Tensor) -> list[torch.Tensor]:
        """Per-sample model-token values -> the response layout, 0 at tool tokens."""
        if self.keep is None:
            return per_sample
        out = []
        for v, k, n in zip(per_sample, self.keep, response_lens.tolist(), strict=True):
            full = torch.zeros(int(n), dtype=v.dtype)
            full[k] = v
            out.append(full)
        return out


@dataclass
class BatchStats:
    kl_sum: float = 0.0
    kl_tokens: float = 0.0
    valid: float = 0.0
    score_sum: float = 0.0  # of the scores as the reward gave them (before shaping)
    explained_variance: float | None = None  # gae: 1 - Var(R - V) / Var(R) over every valid token
    score_moments: algorithms.RunningMoments | None = None  # rewardShaping.normalize: after this batch
    zero_advantage_groups: float = 0.0  # group estimators: groups whose every valid sample's advantage is 0


def shaped_scores(x: ShardInputs, shaping: dict[str, Any] | None) -> torch.Tensor:
    """rewardShaping before normalisation: the score clipped, then DAPO's overlong penalty added."""
    scores = x.scores.float()
    if not shaping:
        return scores
    scores = algorithms.clip_scores(scores, shaping.get("clip"))
    if shaping.get("overlong_buffer"):
        scores = scores + algorithms.overlong_penalty(
            x.response_lens,
            int(shaping["max_response_length"]),
            int(shaping["overlong_buffer"]),
            float(shaping["overlong_penalty"]),
        )
    return scores


def compute(
    shards: dict[int, ShardInputs], algo: dict[str, Any], reduce: Reduce = no_reduce
) -> tuple[dict[int, ShardAdvantages], BatchStats]:
    """Advantages per shard (every actor rank must call this together when `reduce` communicates)."""
    est, kl_coef, gamma = algo["estimator"], float(algo["kl_coef"]), float(algo["gamma"])
    kl_kind = str(algo.get("kl_reward_estimator", "k1"))
    shaping = algo.get("shaping")
    stats = BatchStats()
    scores = {s: shaped_scores(x, shaping) for s, x in shards.items()}
    if shaping and shaping.get("normalize"):  # running moments over every rank's valid scores
        local = torch.zeros(3, dtype=torch.float64)
        for s, x in shards.items():
            local += algorithms.whitening_moments([scores[s][x.valid]])
        before = algorithms.RunningMoments(**(algo.get("score_moments") or {}))
        stats.score_moments = before.merged(reduce(local))
        scores = {s: algorithms.normalise_scores(v, stats.score_moments) for s, v in scores.items()}
    # Per shard, per sample: over its model tokens only (ModelTokens), laid back out at the end.
    raw: dict[int, list[torch.Tensor]] = {}
    returns: dict[int, list[torch.Tensor]] = {}
    values: dict[int, list[torch.Tensor]] = {}
    where = {s: ModelTokens.of(x) for s, x in shards.items()}
    for s, x in shards.items():
        at = where[s]
        lens = at.lens(x.response_lens)
        score = scores[s]
        if x.old_logprobs is not None and x.ref_logprobs is not None:
            kl_tok = algorithms.kl_per_token(x.old_logprobs, x.ref_logprobs, kl_kind)
        else:
            kl_tok = torch.zeros(int(x.response_lens.sum()))
        kls = at.take(split_per_response(kl_tok, x.response_lens))
        if kl_kind != "k1" and x.old_logprobs is not None and x.ref_logprobs is not None:
            kl_stat = algorithms.kl_per_token(x.old_logprobs, x.ref_logprobs, "k1")  # reported: always k1
        else:
            kl_stat = kl_tok
        if est == "gae":
            if x.values is None:
                raise ValueError("gae needs the critic's values")
            rewards = [algorithms.token_rewards(float(score[i]), kls[i], kl_coef) for i in range(len(kls))]
            values[s] = at.take(split_per_response(x.values, x.response_lens))
            adv = algorithms.gae(rewards, values[s], gamma, float(algo["lam"]))
            raw[s], returns[s] = adv.advantages, adv.returns
        elif est == "grpo":  # groups are whole within a shard: no batch-wide moments needed
            raw[s] = algorithms.grpo(
                score, x.group, lens, x.valid, bool(algo.get("grpo_scale", True))
            ).advantages
        elif est == "rloo":
            raw[s] = algorithms.rloo(score, x.group, lens, x.valid).advantages
        elif est in ("reinforce_pp", "reinforce_pp_baseline"):
            baseline = est == "reinforce_pp_baseline"
            raw[s] = algorithms.reinforce_pp_returns(score, x.group, kls, kl_coef, gamma, x.valid, baseline)
        else:
            raise ValueError(f"unknown advantage estimator {est!r}")
        vmask = torch.repeat_interleave(x.valid, x.response_lens)
        if x.loss_mask is not None:  # the KL of the model's tokens: a tool's were not sampled from pi
            vmask = vmask & (x.loss_mask > 0)
        stats.kl_sum += float(kl_stat[vmask].sum())
        stats.kl_tokens += float(vmask.sum())
        stats.valid += float(x.valid.sum())
        stats.score_sum += float(x.scores[x.valid].sum())

    out: dict[int, ShardAdvantages] = {}
    if est in ("grpo", "rloo"):
        for s, x in shards.items():
            stats.zero_advantage_groups += zero_groups(raw[s], x.group, x.valid)
        for s, x in shards.items():
            out[s] = ShardAdvantages(_cat(where[s].expand(raw[s], x.response_lens)), None)
        return out, stats
    local = torch.zeros(3, dtype=torch.float64)
    for s, x in shards.items():
        local += algorithms.whitening_moments(raw[s], x.valid)
    moments = reduce(local)
    for s, x in shards.items():
        whitened = where[s].expand(algorithms.whiten_with(raw[s], moments, x.valid), x.response_lens)
        targets = _cat(where[s].expand(returns[s], x.response_lens)) if est == "gae" else None
        out[s] = ShardAdvantages(_cat(whitened), targets)
    if est == "gae":
        stats.explained_variance = explained_variance(shards, returns, reduce, values)
    return out, stats


def zero_groups(advantages: list[torch.Tensor], group: torch.Tensor, valid: torch.Tensor) -> float:
    """Groups with a valid sample whose valid samples' advantages are all zero: they train nothing but
    the KL (what dynamic sampling exists to avoid)."""
    per_sample = torch.tensor([float(a.abs().max()) if a.numel() else 0.0 for a in advantages])
    count = 0
    for g in torch.unique(group):
        idx = (group == g) & valid
        if bool(idx.any()) and float(per_sample[idx].max()) <= ZERO_ADVANTAGE:
            count += 1
    return float(count)


def explained_variance(
    shards: dict[int, ShardInputs],
    returns: dict[int, list[torch.Tensor]],
    reduce: Reduce = no_reduce,
    values: dict[int, list[torch.Tensor]] | None = None,
) -> float:
    """1 - Var(returns - values) / Var(returns) over every valid token of the batch: 1 is a perfect
    critic, 0 one that predicts only the mean, below 0 worse than that (verl's and OpenRLHF's metric).
    `values`: per shard, per sample, aligned with `returns` (the model tokens'); default the shards'."""
    ret_moments = torch.zeros(3, dtype=torch.float64)
    err_moments = torch.zeros(3, dtype=torch.float64)
    for s, x in shards.items():
        if values is not None:
            per_sample = values[s]
        else:
            per_sample = split_per_response(x.values, x.response_lens) if x.values is not None else []
        errors = [r - v for r, v in zip(returns[s], per_sample, strict=True)]
        ret_moments += algorithms.whitening_moments(returns[s], x.valid)
        err_moments += algorithms.whitening_moments(errors, x.valid)
    both = reduce(torch.cat([ret_moments, err_moments]))
    var_ret, var_err = _variance(both[:3]), _variance(both[3:])
    return 1.0 - var_err / var_ret if var_ret > 0 else 0.0


def _variance(moments: torch.Tensor) -> float:
    total, total_sq, count = (float(v) for v in moments)
    if count <= 0:
        return 0.0
    mean = total / count
    return max(total_sq / count - mean * mean, 0.0)


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(parts) if parts else torch.zeros(0)
