"""The policy (actor): a DeepSpeed ZeRO-3 engine that scores, trains and publishes its weights.

Owns old log-probs, the PPO policy update (with the GRPO KL loss) and the bucketed ZeRO-3 gather that
feeds weight sync. It does not choose advantages (algorithms.py) nor talk to engines (the channel does).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from rlhf_trainer import algorithms
from rlhf_trainer.transfer import PackedRollout, pad_response_values
from rlhf_trainer.weight_sync.bucketing import Bucket, pack_bucket, plan_buckets
from rlhf_trainer.weight_sync.channels import WeightChannel
from rlhf_trainer.workers.deepspeed_utils import (
    ds_config,
    full_shape,
    load_hf_model,
    response_logprobs,
    training_state_digest,
)


class PolicyModel:
    def __init__(self, path: str, settings: dict[str, Any]) -> None:
        import deepspeed

        self.s = settings
        self.rank = int(settings["rank"])
        dtype = torch.bfloat16 if settings["bf16"] else torch.float32
        cfg = ds_config(
            zero_stage=settings["zero_stage"],
            micro_batch=settings["train_micro_batch"],
            grad_accum=settings["grad_accum"],
            world_size=settings["world_size"],
            bf16=settings["bf16"],
            offload=settings["offload"],
            train=True,
        )
        model, keepalive = load_hf_model(path, "causal_lm", cfg, dtype)
        if settings.get("gradient_checkpointing"):
            model.gradient_checkpointing_enable()
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=settings["lr"], betas=(0.9, 0.95), weight_decay=0.0, eps=1e-8
        )
        schedule = algorithms.lr_lambda(
            settings["lr_scheduler"], settings["lr_warmup_steps"], settings["total_steps"]
        )

        def make_scheduler(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
            return torch.optim.lr_scheduler.LambdaLR(opt, schedule)

        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=make_scheduler, config=cfg
        )
        del keepalive
        self.pad_id = int(settings["pad_id"])
        self.temperature = float(settings.get("temperature", 1.0))

    # ---- experience ---------------------------------------------------------------------------
    @torch.no_grad()
    def logprobs(self, rollout: PackedRollout, micro_batch: int) -> torch.Tensor:
        self.engine.eval()
        out = [
            response_logprobs(self.engine, rollout, s, e, self.pad_id, self.temperature)[0]
            for s, e in rollout.micro_batches(micro_batch)
        ]
        return torch.cat(out) if out else torch.zeros(0)

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
        stats = {"policy_loss": 0.0, "clip_frac": 0.0, "kl_loss": 0.0}
        t0 = time.perf_counter()
        for _ in range(epochs):
            for s, e in rollout.micro_batches(micro_batch):
                sl = slice(int(offsets[s]), int(offsets[e]))
                _, lp, act = response_logprobs(self.engine, rollout, s, e, self.pad_id, self.temperature)
                sample_valid = valid[s:e].float().unsqueeze(1).to(act.device)
                mask = act * sample_valid
                old = pad_response_values(old_logprobs[sl], act.cpu()).to(act.device)
                adv = pad_response_values(advantages[sl], act.cpu()).to(act.device)
                loss_sum, clipped = algorithms.policy_loss(lp, old, adv, mask, clip)
                loss = loss_sum
                if kl_loss_coef > 0 and ref_logprobs is not None:
                    ref = pad_response_values(ref_logprobs[sl], act.cpu()).to(act.device)
                    kl = (algorithms.kl_per_token(lp, ref, "k3") * mask).sum()
                    loss = loss + kl_loss_coef * kl
                    stats["kl_loss"] += float(kl.detach()) / denom / epochs
                # DeepSpeed divides by gradient_accumulation_steps; we want a token mean over the rank.
                self.engine.backward(loss / denom * ga)
                self.engine.step()
                stats["policy_loss"] += float(loss_sum.detach()) / denom / epochs
                stats["clip_frac"] += float(clipped) / denom / epochs
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
                    flat = pack_bucket(bucket, [p.data.detach().cpu() for p in group])
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

    # ---- checkpoint -----------------------------------------------------------------------------
    def save(self, directory: str, tag: str) -> None:
        self.engine.save_checkpoint(directory, tag=tag, save_latest=False)

    def load(self, directory: str, tag: str) -> None:
        path, _ = self.engine.load_checkpoint(
            directory, tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True
        )
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint {tag!r} under {directory}")

    def state_digest(self) -> dict[str, float]:
        return training_state_digest(self.optimizer, self.scheduler)
