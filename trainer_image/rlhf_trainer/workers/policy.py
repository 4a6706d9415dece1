"""The policy (actor): a DeepSpeed ZeRO-3 engine that scores, trains and publishes its weights.

Owns old log-probs, the PPO policy update (with the GRPO KL loss) and the bucketed ZeRO-3 gather that
feeds weight sync. It does not choose advantages (algorithms.py) nor talk to engines (the channel does).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from rlhf_trainer import algorithms
from rlhf_trainer.sequence_parallel import SequenceParallel
from rlhf_trainer.transfer import PackedRollout
from rlhf_trainer.weight_sync.bucketing import Bucket, pack_bucket, plan_buckets
from rlhf_trainer.weight_sync.channels import WeightChannel
from rlhf_trainer.workers import optim_steps
from rlhf_trainer.workers.deepspeed_utils import (
    ResponseScorer,
    TrainedRole,
    all_reduce_sum,
    build_engine,
    full_shape,
    response_logprobs,
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
        self.temperature = float(settings.get("temperature", 1.0))

    # ---- experience ---------------------------------------------------------------------------

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
        clip: float,
        kl_loss_coef: float,
        mini_batches: int = 1,
        aggregation: str = "token-mean",
        off_policy: dict[str, Any] | None = None,
    ) -> dict[str, float]:
        """PPO epochs over this rank's samples, `mini_batches` optimizer steps each; packed per-token
        tensors are in rollout order. `old_logprobs` None: the training pass's own detached log-probs
        (config.old_logprobs_redundant: one epoch of one mini-batch is on-policy, the ratio is 1).
        `off_policy` ({correction, cap}, async RL): the old log-probs are the proximal policy's, and each
        token's loss is weighted by pi_prox / pi_behav, the behaviour log-probs being the engine's."""
        steps = optim_steps.for_engine(
            self.engine, self.sp, int(self.s["grad_accum"]), rollout, valid,
            mini_batches=mini_batches, micro_batch=micro_batch, mode=aggregation,
        )  # fmt: skip
        # policy loss (aggregated), clipped tokens, KL loss (aggregated), k1 KL over tokens, valid tokens,
        # |log-prob - the engine's| and the tokens it is taken over (the first mini-batch, before any update)
        # (with off_policy) the behaviour weights' sum and the tokens the correction dropped
        sums = torch.zeros(9, dtype=torch.float64)
        first_ratio_dev = 0.0  # |ratio - 1| on the first micro-batch: dropout or a stale old log-prob shows
        t0 = time.perf_counter()
        for epoch in range(epochs):
            for m, micro in enumerate(steps.mini_batches):
                for s, e in micro:
                    sl = steps.tokens(s, e)
                    out = response_logprobs(
                        self.engine, rollout, s, e, self.pad_id, self.temperature, self.sp
                    )
                    lp, act = out.values, out.mask
                    mask = act * valid[s:e].float().unsqueeze(1).to(act.device)
                    old = out.local(old_logprobs[sl]) if old_logprobs is not None else lp.detach()
                    if off_policy is None:
                        tok_loss, clipped = algorithms.policy_loss_tokens(
                            lp, old, out.local(advantages[sl]), clip
                        )
                    else:
                        correction, cap = str(off_policy["correction"]), float(off_policy["cap"])
                        behaviour = out.local(rollout.rollout_logprobs[sl])
                        tok_loss, clipped, kept = algorithms.decoupled_policy_loss_tokens(
                            lp, old, behaviour, out.local(advantages[sl]), clip, correction, cap
                        )
                        if epoch == 0:
                            weight, _ = algorithms.behaviour_weights(old, behaviour, correction, cap)
                            sums[7] += float((weight * mask).sum())
                            sums[8] += float(((1.0 - kept) * mask).sum())
                    if epoch == 0 and m == 0 and s == 0 and bool(mask.any()):
                        first_ratio_dev = float(((lp.detach() - old).exp() - 1.0).abs()[mask > 0].max())
                    if epoch == 0 and m == 0:  # trainer vs engine on the same weights: the off-policy gap
                        engine_lp = out.local(rollout.rollout_logprobs[sl])
                        sums[5] += float(((lp.detach() - engine_lp).abs() * mask).sum())
                        sums[6] += float(mask.sum())
                    seq_tokens = optim_steps.sequence_tokens(rollout, valid, s, e).to(act.device)
                    norm = steps.normalisers[m]
                    loss = algorithms.aggregate_loss(tok_loss, mask, aggregation, norm, seq_tokens)
                    kl_loss = torch.zeros((), device=lp.device)
                    if ref_logprobs is not None:
                        ref = out.local(ref_logprobs[sl])
                        if kl_loss_coef > 0:
                            kl_tok = algorithms.kl_per_token(lp, ref, "k3")
                            kl_loss = algorithms.aggregate_loss(kl_tok, mask, aggregation, norm, seq_tokens)
                            loss = loss + kl_loss_coef * kl_loss
                        if epoch == 0:  # the KL statistic (k1) when no old-log-probs pass computed it
                            sums[3] += float((algorithms.kl_per_token(lp.detach(), ref, "k1") * mask).sum())
                    # Under SP each rank's loss covers only its columns of the group's samples, and autograd
                    # through the all-to-all sends every column's gradient back to the rank owning the
                    # weights' inputs; the normaliser counts each sample once, so the sum over all W ranks
                    # of these shares is the global mean (tests/unit/test_trainer_sequence_parallel.py,
                    # test_trainer_data_parallel.py).
                    self.engine.backward(loss * steps.scale)
                    self.engine.step()
                    sums[0] += float(loss.detach())
                    sums[1] += float((clipped * mask).sum())
                    sums[2] += float(kl_loss.detach())
                    if epoch == 0:
                        sums[4] += float(mask.sum())
        # Every rank reports the global figures. Under SP each rank counted only its columns, so the sum
        # over the world counts every token once, as it does the loss shares.
        sums = all_reduce_sum(sums, steps.device)
        tokens = max(float(sums[4]), 1.0)
        stats = {
            "policy_loss": float(sums[0]) / max(epochs * len(steps.mini_batches), 1),
            "clip_frac": float(sums[1]) / tokens / epochs,
            "kl_loss": float(sums[2]) / max(epochs * len(steps.mini_batches), 1),
            "kl": float(sums[3]) / tokens,
            "first_ratio_deviation": first_ratio_dev,
            # mean |trainer log-prob - vLLM's processed log-prob| of the sampled tokens: numerics only
            # when both use the same distribution (temperature applied on both sides)
            "rollout_logprob_gap": float(sums[5]) / max(float(sums[6]), 1.0),
            "optimizer_steps": float(epochs * len(steps.mini_batches)),
        }
        if off_policy is not None:
            stats["behaviour_weight_mean"] = float(sums[7]) / tokens
            stats["behaviour_dropped_frac"] = float(sums[8]) / tokens
        stats["seconds"] = time.perf_counter() - t0
        stats["lr"] = float(self.scheduler.get_last_lr()[0]) if self.scheduler is not None else 0.0
        return stats

    # ---- weight sync ----------------------------------------------------------------------------
    def weight_plan(self, bucket_bytes: int) -> list[Bucket]:
        params = [(n, full_shape(p), p.dtype) for n, p in self.engine.module.named_parameters()]
        return plan_buckets(params, bucket_bytes)

    def send_weights(self, plan: list[Bucket], channel: WeightChannel | None) -> dict[str, float]:
        """Gather each bucket's ZeRO-3 partitions (collective on every actor rank); rank 0 sends it once."""
        import deepspeed

        params = dict(self.engine.module.named_parameters())
        t_gather = t_send = 0.0
        nbytes = 0
        for index, bucket in enumerate(plan):
            group = [params[n] for n in bucket.names]
            t0 = time.perf_counter()
            with deepspeed.zero.GatheredParameters(group, modifier_rank=None):
                t1 = time.perf_counter()
                t_gather += t1 - t0
                if self.rank == 0 and channel is not None:
                    # Packed straight into the transport's memory (the shm file, a reused buffer, or
                    # the GPU for NCCL): no fresh buffer and no host round trip per bucket.
                    staged = channel.staging(bucket, index)
                    flat = pack_bucket(bucket, [p.data.detach() for p in group], out=staged)
                    channel.send(flat, index)
                    nbytes += bucket.nbytes
                    t_send += time.perf_counter() - t1
        return {
            "gather_seconds": t_gather,
            "send_seconds": t_send,
            "bytes": float(nbytes),
            "buckets": len(plan),
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
