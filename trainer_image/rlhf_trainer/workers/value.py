"""The critic: a DeepSpeed ZeRO-3 value model (HF token-classification head, one label) for gae.

Owns value estimates per response token and the clipped value-loss update. It never sees rewards
directly: returns come from the actor ranks' advantage computation.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from rlhf_trainer import algorithms
from rlhf_trainer.sequence_parallel import SequenceParallel
from rlhf_trainer.transfer import PackedRollout
from rlhf_trainer.workers.deepspeed_utils import TrainedRole, build_engine, over_micro_batches, token_values


class ValueModel(TrainedRole):
    """The critic role's model: token values from an HF token-classification head."""

    def __init__(self, path: str, settings: dict[str, Any], sp: SequenceParallel | None = None) -> None:
        self.s = settings
        self.sp = sp
        built = build_engine(path, settings, sp, head="value", train=True)
        self.engine, self.optimizer, self.scheduler = built.engine, built.optimizer, built.scheduler
        self.pad_id = int(settings["pad_id"])

    @torch.no_grad()
    def values(self, rollout: PackedRollout, micro_batch: int) -> torch.Tensor:
        return over_micro_batches(
            self.engine,
            rollout,
            micro_batch,
            lambda s, e: token_values(self.engine, rollout, s, e, self.pad_id, self.sp),
        )

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
