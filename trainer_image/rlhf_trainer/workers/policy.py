"""The policy (actor): a DeepSpeed ZeRO-3 engine that scores, trains and publishes its weights.

Owns old log-probs, the PPO policy update (with the GRPO KL loss) and the bucketed ZeRO-3 gather that
feeds weight sync. It does not choose advantages (algorithms.py) nor talk to engines (the channel does).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Any

import torch

from rlhf_trainer import algorithms
from rlhf_trainer.sequence_parallel import SequenceParallel
from rlhf_trainer.transfer import PackedRollout
from rlhf_trainer.weight_sync.bucketing import (
    Bucket,
    StagingBuffer,
    dtype_from_name,
    pack_bucket,
    plan_buckets,
)
from rlhf_trainer.weight_sync.channels import WeightChannel
from rlhf_trainer.weight_sync.delta import digest
from rlhf_trainer.weight_sync.delta_wire import DeltaSender
from rlhf_trainer.workers import optim_steps
from rlhf_trainer.workers.deepspeed_utils import (
    ResponseScorer,
    TrainedRole,
    all_reduce_sum,
    build_engine,
    full_shape,
    resolve_packing,
    response_logprobs,
)


@dataclass(frozen=True)
class PolicyLoss:
    """The policy loss's settings (spec.algorithm, via config.algorithm_wire)."""

    policy_loss: str = "ppo"  # or gspo
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None
    entropy_coef: float = 0.0
    kl_loss_coef: float = 0.0  # the KL in the loss (grpo, rloo); 0: none
    kl_estimator: str = "k3"
    aggregation: str = "token-mean"
    norm_constant: float = 1.0  # seq-mean-token-sum-norm's constant
    correction: dict[str, Any] | None = None  # {level, mode, lower, upper}: algorithms.rollout_weights

    @classmethod
    def from_wire(cls, algo: dict[str, Any]) -> PolicyLoss:
        return cls(
            policy_loss=str(algo["policy_loss"]),
            clip_low=float(algo["clip_low"]),
            clip_high=float(algo["clip_high"]),
            dual_clip=None if algo["dual_clip"] is None else float(algo["dual_clip"]),
            entropy_coef=float(algo["entropy_coef"]),
            kl_loss_coef=float(algo["kl_coef"]) if algo["kl_in_loss"] else 0.0,
            kl_estimator=str(algo["kl_loss_estimator"]),
            aggregation=str(algo["loss_aggregation"]),
            norm_constant=float(algo["norm_constant"]),
            correction=algo["correction"],
        )


class PolicyModel(ResponseScorer, TrainedRole):
    """The actor role's model (the policy being trained)."""

    def __init__(self, path: str, settings: dict[str, Any], sp: SequenceParallel | None = None) -> None:
        self.s = settings
        self.sp = sp
        self.rank = int(settings["rank"])
        built = build_engine(path, settings, sp, head="causal_lm", train=True)
        self.engine, self.optimizer, self.scheduler = built.engine, built.optimizer, built.scheduler
        self.pad_id = int(settings["pad_id"])
        self._host_staging = StagingBuffer()  # the delta sync packs each bucket here to compare it
        self.temperature = float(settings.get("temperature", 1.0))
        self.top_p = float(settings.get("top_p", 1.0))
        self.packing = resolve_packing(self.engine, settings, sp, "actor")

    # ---- training -------------------------------------------------------------------------------
    def train(
        self,
        rollout: PackedRollout,
        old_logprobs: torch.Tensor | None,
        advantages: torch.Tensor,
        ref_logprobs: torch.Tensor | None,
        valid: torch.Tensor,
        *,
        micro_batch: int,
        epochs: int,
        mini_batches: int = 1,
        loss: PolicyLoss | None = None,
    ) -> dict[str, float]:
        """PPO epochs over this rank's samples, `mini_batches` optimizer steps each; packed per-token
        tensors are in rollout order. With packing the micro-batches are packed rows balanced by tokens
        (same count); their results come back in the padded layout, so the loss and statistics are the
        padded path's. `old_logprobs` None: the training pass's own detached log-probs
        (config.old_logprobs_redundant: one epoch of one mini-batch is on-policy, the ratio is 1). With
        `loss.correction` each token's loss is weighted by pi_prox / pi_behav, the behaviour log-probs
        being the engine's (the kernels' gap; in async mode also the older weights). A rollout with a loss
        mask (rollout.agent) trains its model tokens only: a tool's tokens get exactly zero gradient and
        count in no normaliser or statistic."""
        cfg = loss or PolicyLoss()
        steps = optim_steps.for_engine(
            self.engine, self.sp, int(self.s["grad_accum"]), rollout, valid,
            mini_batches=mini_batches, micro_batch=micro_batch, mode=cfg.aggregation, by_tokens=self.packing,
        )  # fmt: skip
        # 0 policy loss (aggregated), 1 tokens where the clip binds, 2 KL loss (aggregated), 3 k1 KL over
        # tokens, 4 valid tokens, 5 |log-prob - the engine's| and 6 the tokens it is taken over (the first
        # mini-batch, before any update), 7 the rollout weights' sum and 8 the tokens the correction dropped,
        # 9 tokens where the dual clip binds, 10 entropy over tokens
        sums = torch.zeros(11, dtype=torch.float64)
        model_tokens = rollout.model_mask()  # rollout.agent: a tool's tokens are 0, trained on by nothing
        first_ratio_dev = 0.0  # |ratio - 1| on the first micro-batch: dropout or a stale old log-prob shows
        gaps: list[torch.Tensor] = []  # trainer - engine log-prob per token of the first mini-batch
        t0 = time.perf_counter()
        for epoch in range(epochs):
            for m, micro in enumerate(steps.mini_batches):
                for s, e in micro:
                    sl = steps.tokens(s, e)
                    out = response_logprobs(
                        self.engine, rollout, s, e, self.pad_id, self.temperature, self.sp, self.top_p,
                        entropy_grad=cfg.entropy_coef > 0, packed=self.packing,
                    )  # fmt: skip
                    lp, act = out.values, out.mask
                    # the loss, its normaliser, the KL, the entropy and the gap figures: model tokens only
                    mask = act * valid[s:e].float().unsqueeze(1).to(act.device) * out.local(model_tokens[sl])
                    old = out.local(old_logprobs[sl]) if old_logprobs is not None else lp.detach()
                    adv = out.local(advantages[sl])
                    if cfg.policy_loss == "gspo":
                        tl = algorithms.gspo_tokens(lp, old, adv, mask, cfg.clip_low, cfg.clip_high)
                    else:
                        tl = algorithms.ppo_tokens(lp, old, adv, cfg.clip_low, cfg.clip_high, cfg.dual_clip)
                    tok_loss, counted = tl.loss, mask
                    engine_lp = out.local(rollout.rollout_logprobs[sl])
                    if cfg.correction is not None:
                        c = cfg.correction
                        weight, kept = algorithms.rollout_weights(
                            old, engine_lp, mask, str(c["level"]), str(c["mode"]),
                            float(c["lower"]), float(c["upper"]),
                        )  # fmt: skip
                        tok_loss, counted = tok_loss * weight, mask * kept
                        if epoch == 0:
                            sums[7] += float((weight * mask).sum())
                            sums[8] += float(((1.0 - kept) * mask).sum())
                    if epoch == 0 and m == 0 and s == 0 and bool(mask.any()):
                        first_ratio_dev = float(((lp.detach() - old).exp() - 1.0).abs()[mask > 0].max())
                    if epoch == 0 and m == 0:  # trainer vs engine: the kernels' gap (and in async the lag)
                        sums[5] += float(((lp.detach() - engine_lp).abs() * mask).sum())
                        sums[6] += float(mask.sum())
                        gaps.append((lp.detach() - engine_lp)[mask > 0].double().cpu())
                    seq_tokens = optim_steps.sequence_tokens(rollout, valid, s, e).to(act.device)
                    norm = steps.normalisers[m]

                    reduce = functools.partial(
                        algorithms.aggregate_loss, mask=mask, mode=cfg.aggregation, normaliser=norm,
                        seq_tokens=seq_tokens, norm_constant=cfg.norm_constant,
                    )  # fmt: skip
                    loss_value = reduce(tok_loss)
                    entropy = out.entropy if out.entropy is not None else torch.zeros_like(lp)
                    if cfg.entropy_coef > 0:
                        loss_value = loss_value - cfg.entropy_coef * reduce(entropy)
                    kl_loss = torch.zeros((), device=lp.device)
                    if ref_logprobs is not None:
                        ref = out.local(ref_logprobs[sl])
                        if cfg.kl_loss_coef > 0:
                            kl_loss = reduce(algorithms.kl_per_token(lp, ref, cfg.kl_estimator))
                            loss_value = loss_value + cfg.kl_loss_coef * kl_loss
                        if epoch == 0:  # the KL statistic (k1) when no old-log-probs pass computed it
                            sums[3] += float((algorithms.kl_per_token(lp.detach(), ref, "k1") * mask).sum())
                    # Under SP each rank's loss covers only its columns of the group's samples, and autograd
                    # through the all-to-all sends every column's gradient back to the rank owning the
                    # weights' inputs; the normaliser counts each sample once, so the sum over all W ranks
                    # of these shares is the global mean (tests/trainer/test_trainer_sequence_parallel.py,
                    # test_trainer_data_parallel.py).
                    self.engine.backward(loss_value * steps.scale)
                    self.engine.step()
                    sums[0] += float(loss_value.detach())
                    sums[1] += float((tl.clipped * counted).sum())
                    sums[2] += float(kl_loss.detach())
                    sums[9] += float((tl.dual_clipped * counted).sum())
                    if epoch == 0:
                        sums[4] += float(mask.sum())
                        sums[10] += float((entropy.detach() * mask).sum())
        # Every rank reports the global figures. Under SP each rank counted only its columns, so the sum
        # over the world counts every token once, as it does the loss shares.
        sums = all_reduce_sum(sums, steps.device)
        tokens = max(float(sums[4]), 1.0)
        updates = max(epochs * len(steps.mini_batches), 1)
        diffs = torch.cat(gaps) if gaps else torch.zeros(0, dtype=torch.float64)
        gap = algorithms.logprob_mismatch(diffs, torch.zeros_like(diffs), torch.ones_like(diffs))
        stats = {
            "policy_loss": float(sums[0]) / updates,
            "clip_frac": float(sums[1]) / tokens / epochs,
            "dual_clip_frac": float(sums[9]) / tokens / epochs,
            "kl_loss": float(sums[2]) / updates,
            "kl": float(sums[3]) / tokens,
            "entropy": float(sums[10]) / tokens,
            "first_ratio_deviation": first_ratio_dev,
            # mean |trainer log-prob - vLLM's processed log-prob| of the sampled tokens: numerics only
            # when both use the same distribution (temperature and top-p applied on both sides)
            "rollout_logprob_gap": float(sums[5]) / max(float(sums[6]), 1.0),
            # this rank's distribution of the signed gap (the driver takes the largest over ranks)
            "logprob_gap_mean": gap["mean"],
            "logprob_gap_p99": gap["p99"],
            "logprob_gap_max": gap["max"],
            "optimizer_steps": float(epochs * len(steps.mini_batches)),
        }
        if cfg.correction is not None:
            stats["behaviour_weight_mean"] = float(sums[7]) / tokens
            stats["behaviour_dropped_frac"] = float(sums[8]) / tokens
        stats["seconds"] = time.perf_counter() - t0
        stats["lr"] = float(self.scheduler.get_last_lr()[0]) if self.scheduler is not None else 0.0
        return stats

    # ---- weight sync ----------------------------------------------------------------------------
    def weight_plan(self, bucket_bytes: int, wire_dtype: torch.dtype | None = None) -> list[Bucket]:
        """Buckets of the actor's parameters, each in `wire_dtype` (the engines' dtype) when it is given
        and the parameter is floating point: the sender casts, so the engines receive what they load."""
        params = [
            (n, full_shape(p), wire_dtype if wire_dtype is not None and p.is_floating_point() else p.dtype)
            for n, p in self.engine.module.named_parameters()
        ]
        return plan_buckets(params, bucket_bytes)

    def send_weights(
        self,
        plan: list[Bucket],
        channel: WeightChannel | None,
        sender: DeltaSender | None = None,
        verify: bool = False,
    ) -> dict[str, Any]:
        """Gather each bucket's ZeRO-3 partitions (collective on every actor rank); rank 0 sends it once,
        whole or (with `sender`) as a delta against the engines' copy. `verify`: rank 0 returns the digest
        of every bucket as the engines must now hold it."""
        import deepspeed

        params = dict(self.engine.module.named_parameters())
        t_gather = t_send = 0.0
        nbytes = 0
        encodings = {"full": 0, "gaps": 0, "bitmask": 0}
        changed = compared = 0
        digests: list[int] = []
        for index, bucket in enumerate(plan):
            group = [params[n] for n in bucket.names]
            t0 = time.perf_counter()
            with deepspeed.zero.GatheredParameters(group, modifier_rank=None):
                t1 = time.perf_counter()
                t_gather += t1 - t0
                if self.rank == 0 and channel is not None:
                    tensors = [p.data.detach() for p in group]
                    if sender is None:
                        # Packed straight into the transport's memory (the shm file, a reused buffer, or
                        # the GPU for NCCL): no fresh buffer and no host round trip per bucket.
                        staged = channel.staging(bucket, index)
                        flat = pack_bucket(bucket, tensors, out=staged)
                        channel.send(flat, index)
                        nbytes += bucket.nbytes
                    else:  # packed in host memory, compared with the engines' copy there
                        flat = pack_bucket(
                            bucket,
                            tensors,
                            out=self._host_staging.get(bucket.numel, dtype_from_name(bucket.dtype)),
                        )
                        d, sent = sender.send(channel, index, flat)
                        nbytes += sent
                        encodings[d.encoding] += 1
                        if d.changed >= 0:
                            changed += d.changed
                            compared += d.numel
                        if verify:
                            digests.append(digest(sender.held[index]))
                    t_send += time.perf_counter() - t1
        return {
            "gather_seconds": t_gather,
            "send_seconds": t_send,
            "bytes": float(nbytes),
            "buckets": len(plan),
            "encodings": encodings,
            "changed": changed,
            "compared": compared,
            "digests": digests,
        }

    def gathered_state_dict(self) -> dict[str, torch.Tensor]:
        """Full weights on rank 0 (collective on every rank); for checks and HF export."""
        import deepspeed

        out: dict[str, torch.Tensor] = {}
        for name, p in self.engine.module.named_parameters():
            with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
                if self.rank == 0:
                    out[name] = p.data.detach().cpu().clone()
        return out
