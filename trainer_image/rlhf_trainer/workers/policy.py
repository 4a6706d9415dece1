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
from rlhf_trainer.workers.deepspeed_utils import (
    ResponseScorer,
    TrainedRole,
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
        old_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        ref_logprobs: torch.Tensor | None,
        valid: torch.Tensor,
        *,
        micro_batch: int,
        epochs: int,
        clip: float,
        kl_loss_coef: float,
    ) -> dict[str, float]:
        """PPO epochs over this rank's samples; packed per-token tensors are in rollout order."""
        self.engine.train()
        resp_lens = rollout.response_lens
        offsets = torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.int64), resp_lens]), 0)
        tokens_valid = float(sum(int(resp_lens[i]) for i in range(rollout.num_samples) if bool(valid[i])))
        denom = max(tokens_valid, 1.0)
        ga = int(self.s["grad_accum"])
        sp_size = self.sp.size if self.sp is not None else 1
        sums = torch.zeros(3, dtype=torch.float64)  # policy loss, clipped tokens, KL loss (summed)
        t0 = time.perf_counter()
        for _ in range(epochs):
            for s, e in rollout.micro_batches(micro_batch):
                sl = slice(int(offsets[s]), int(offsets[e]))
                out = response_logprobs(self.engine, rollout, s, e, self.pad_id, self.temperature, self.sp)
                lp, act = out.values, out.mask
                mask = act * valid[s:e].float().unsqueeze(1).to(act.device)
                old, adv = out.local(old_logprobs[sl]), out.local(advantages[sl])
                loss_sum, clipped = algorithms.policy_loss(lp, old, adv, mask, clip)
                loss = loss_sum
                kl = torch.zeros(())
                if kl_loss_coef > 0 and ref_logprobs is not None:
                    kl = (algorithms.kl_per_token(lp, out.local(ref_logprobs[sl]), "k3") * mask).sum()
                    loss = loss + kl_loss_coef * kl
                # DeepSpeed divides by gradient_accumulation_steps; we want a token mean over the rank.
                # Under SP each rank's loss covers only its columns of the group's samples, and autograd
                # through the all-to-all sends every column's gradient back to the rank owning the weights'
                # inputs, so the SP group's summed gradient is that of the whole micro-batch. DeepSpeed then
                # averages over all W = dp x sp ranks; multiplying by sp makes that the average over the dp
                # groups, i.e. exactly the sp=1 gradient (tests/unit/test_trainer_sequence_parallel.py).
                self.engine.backward(loss / denom * ga * sp_size)
                self.engine.step()
                sums += torch.tensor([float(loss_sum.detach()), float(clipped), float(kl.detach())])
        if self.sp is not None and self.sp.size > 1:  # partial sums per column slice -> the group's sums
            on_device = sums.to(next(self.engine.parameters()).device)  # NCCL reduces device tensors
            torch.distributed.all_reduce(on_device, group=self.sp.group)
            sums = on_device.cpu()
        stats = {
            "policy_loss": float(sums[0]) / denom / epochs,
            "clip_frac": float(sums[1]) / denom / epochs,
            "kl_loss": float(sums[2]) / denom / epochs,
        }
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
