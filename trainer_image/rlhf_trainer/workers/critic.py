"""The critic: a DeepSpeed ZeRO-3 value model (HF token-classification head, one label) for gae.

Owns value estimates per response token and the clipped value-loss update. It never sees rewards
directly: returns come from the actor ranks' advantage computation.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from rlhf_trainer import algorithms, sequence_parallel
from rlhf_trainer.sequence_parallel import SequenceParallel
from rlhf_trainer.transfer import PackedRollout
from rlhf_trainer.workers.deepspeed_utils import ds_config, load_hf_model, token_values, training_state_digest


class ValueModel:
    def __init__(self, path: str, settings: dict[str, Any], sp: SequenceParallel | None = None) -> None:
        import deepspeed

        self.s = settings
        self.sp = sp
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
        model, keepalive = load_hf_model(path, "value", cfg, dtype)
        sequence_parallel.enable(model, sp)
        if settings.get("gradient_checkpointing"):
            model.gradient_checkpointing_enable()
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=settings["lr"], betas=(0.9, 0.95), weight_decay=0.0
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

    @torch.no_grad()
    def values(self, rollout: PackedRollout, micro_batch: int) -> torch.Tensor:
        self.engine.eval()
        out = [
            token_values(self.engine, rollout, s, e, self.pad_id, self.sp).packed()
            for s, e in rollout.micro_batches(micro_batch)
        ]
        return torch.cat(out) if out else torch.zeros(0)

    def train(
        self,
        rollout: PackedRollout,
        old_values: torch.Tensor,
        returns: torch.Tensor,
        valid: torch.Tensor,
        *,
        micro_batch: int,
        epochs: int,
        clip: float,
    ) -> dict[str, float]:
        self.engine.train()
        resp_lens = rollout.response_lens
        offsets = torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.int64), resp_lens]), 0)
        denom = max(float(sum(int(resp_lens[i]) for i in range(rollout.num_samples) if bool(valid[i]))), 1.0)
        ga = int(self.s["grad_accum"])
        sp_size = self.sp.size if self.sp is not None else 1
        total = torch.zeros(1, dtype=torch.float64)
        t0 = time.perf_counter()
        for _ in range(epochs):
            for s, e in rollout.micro_batches(micro_batch):
                sl = slice(int(offsets[s]), int(offsets[e]))
                out = token_values(self.engine, rollout, s, e, self.pad_id, self.sp)
                mask = out.mask * valid[s:e].float().unsqueeze(1).to(out.mask.device)
                loss = algorithms.value_loss(
                    out.values, out.local(old_values[sl]), out.local(returns[sl]), mask, clip
                )
                # x sp: DeepSpeed averages over dp x sp ranks, each holding a column slice (see actor.train)
                self.engine.backward(loss / denom * ga * sp_size)
                self.engine.step()
                total += float(loss.detach())
        if self.sp is not None and self.sp.size > 1:
            on_device = total.to(next(self.engine.parameters()).device)  # NCCL reduces device tensors
            torch.distributed.all_reduce(on_device, group=self.sp.group)
            total = on_device.cpu()
        total_loss = float(total[0]) / denom / epochs
        return {"value_loss": total_loss, "seconds": time.perf_counter() - t0}

    def state_digest(self) -> dict[str, float]:
        return training_state_digest(self.optimizer, self.scheduler)

    def save(self, directory: str, tag: str) -> None:
        self.engine.save_checkpoint(directory, tag=tag, save_latest=False)

    def load(self, directory: str, tag: str) -> None:
        path, _ = self.engine.load_checkpoint(
            directory, tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True
        )
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint {tag!r} under {directory}")
