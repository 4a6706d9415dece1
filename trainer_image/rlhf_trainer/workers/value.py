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
from rlhf_trainer.workers import optim_steps
from rlhf_trainer.workers.deepspeed_utils import (
    TrainedRole,
    all_reduce_sum,
    build_engine,
    over_micro_batches,
    resolve_packing,
    token_values,
)


class ValueModel(TrainedRole):
    """The critic role's model: token values from an HF token-classification head."""

    def __init__(self, path: str, settings: dict[str, Any], sp: SequenceParallel | None = None) -> None:
        self.s = settings
        self.sp = sp
        built = build_engine(path, settings, sp, head="value", train=True)
        self.engine, self.optimizer, self.scheduler = built.engine, built.optimizer, built.scheduler
        self.pad_id = int(settings["pad_id"])
        self.packing = resolve_packing(self.engine, settings, sp, "critic")

    @torch.no_grad()
    def values(self, rollout: PackedRollout, micro_batch: int) -> torch.Tensor:
        return over_micro_batches(
            self.engine,
            rollout,
            micro_batch,
            lambda s, e: token_values(self.engine, rollout, s, e, self.pad_id, self.sp, packed=self.packing),
            by_tokens=self.packing,
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
        mini_batches: int = 1,
        aggregation: str = "token-mean",
    ) -> dict[str, float]:
        """Clipped value-loss epochs, `mini_batches` optimizer steps each, normalised like the actor's."""
        steps = optim_steps.for_engine(
            self.engine, self.sp, int(self.s["grad_accum"]), rollout, valid,
            mini_batches=mini_batches, micro_batch=micro_batch, mode=aggregation, by_tokens=self.packing,
        )  # fmt: skip
        total = torch.zeros(1, dtype=torch.float64)
        model_tokens = rollout.model_mask()  # rollout.agent: no value loss on a tool's tokens
        first_value_dev = 0.0  # |V - V_old| on the first micro-batch: dropout in the critic shows here
        t0 = time.perf_counter()
        for epoch in range(epochs):
            for m, micro in enumerate(steps.mini_batches):
                for s, e in micro:
                    sl = steps.tokens(s, e)
                    out = token_values(self.engine, rollout, s, e, self.pad_id, self.sp, packed=self.packing)
                    mask = out.mask * valid[s:e].float().unsqueeze(1).to(out.mask.device)
                    mask = mask * out.local(model_tokens[sl])
                    old = out.local(old_values[sl])
                    if epoch == 0 and m == 0 and s == 0 and bool(mask.any()):
                        first_value_dev = float((out.values.detach() - old).abs()[mask > 0].max())
                    tok_loss = algorithms.value_loss_tokens(out.values, old, out.local(returns[sl]), clip)
                    seq_tokens = optim_steps.sequence_tokens(rollout, valid, s, e).to(mask.device)
                    loss = algorithms.aggregate_loss(
                        tok_loss, mask, aggregation, steps.normalisers[m], seq_tokens
                    )
                    self.engine.backward(loss * steps.scale)  # the global mean (see PolicyModel.train)
                    self.engine.step()
                    total += float(loss.detach())
        total = all_reduce_sum(total, steps.device)
        return {
            "value_loss": float(total[0]) / max(epochs * len(steps.mini_batches), 1),
            "first_value_deviation": first_value_dev,
            "seconds": time.perf_counter() - t0,
        }
