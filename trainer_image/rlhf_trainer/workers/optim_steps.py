"""How a rank's share of a step becomes optimizer steps: mini-batches, their global loss normalisers and
the factor that undoes DeepSpeed's own averaging.

The loss of a mini-batch is a mean over the whole step's mini-batch on every data-parallel rank (the
global count of valid tokens, or of valid sequences), as OpenRLHF's and verl's aggregation do: a rank
with fewer valid tokens does not weigh more, and a rank whose samples are all invalid does not shrink the
step. Shared by the actor and the critic; no Ray here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rlhf_trainer import algorithms
from rlhf_trainer.sequence_parallel import SequenceParallel
from rlhf_trainer.transfer import PackedRollout
from rlhf_trainer.workers.deepspeed_utils import all_reduce_sum, world_size


@dataclass(frozen=True)
class OptimSteps:
    """This rank's optimizer steps of one epoch, and what each micro-batch's loss is divided by.

    mini_batches: per optimizer step, its [start, end) micro-batches of this rank's samples.
    normalisers: per optimizer step, the aggregation's denominator over every rank (all-reduced).
    scale: what each micro-batch's loss is multiplied by before `engine.backward`: DeepSpeed divides by
    its gradient accumulation steps and averages gradients over the W ranks, so x (W x accumulation)
    leaves the plain sum of every rank's share, i.e. the global mean.
    """

    mini_batches: list[list[tuple[int, int]]]
    normalisers: list[float]
    scale: float
    offsets: torch.Tensor  # where each sample's response tokens start in packed per-token tensors
    device: torch.device | None = None  # the model's (NCCL reduces device tensors only)

    def tokens(self, start: int, end: int) -> slice:
        """Packed per-token positions of samples [start, end)."""
        return slice(int(self.offsets[start]), int(self.offsets[end]))

    @property
    def total(self) -> float:
        """The sum of the normalisers (for per-token statistics over the whole epoch)."""
        return float(sum(self.normalisers))


def plan(
    rollout: PackedRollout,
    valid: torch.Tensor,
    *,
    mini_batches: int,
    micro_batch: int,
    grad_accum: int,
    mode: str,
    sp_size: int = 1,
    device: torch.device | None = None,
    by_tokens: bool = False,
) -> OptimSteps:
    """One all-reduce: every mini-batch's normaliser summed over the ranks. Each rank of a sequence-parallel
    group holds the same samples, so the sum counts them sp_size times: divided out here. `by_tokens`
    (packing): each mini-batch's micro-batches balanced by tokens (PackedRollout.mini_batches)."""
    batches = rollout.mini_batches(mini_batches, micro_batch, by_tokens)
    counted = rollout.model_lens  # the loss's tokens: a tool's tokens (rollout.agent) are not among them
    local = torch.tensor(
        [
            algorithms.sample_normaliser(counted[mb[0][0] : mb[-1][1]], valid[mb[0][0] : mb[-1][1]], mode)
            for mb in batches
        ],
        dtype=torch.float64,
    )
    totals = all_reduce_sum(local, device) / sp_size
    offsets = torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.int64), rollout.response_lens]), 0)
    return OptimSteps(batches, [float(x) for x in totals], float(world_size() * grad_accum), offsets, device)


def for_engine(
    engine: Any,
    sp: SequenceParallel | None,
    grad_accum: int,
    rollout: PackedRollout,
    valid: torch.Tensor,
    *,
    mini_batches: int,
    micro_batch: int,
    mode: str,
    by_tokens: bool = False,
) -> OptimSteps:
    """`plan` for a trained role's engine (switched to train mode here)."""
    engine.train()
    return plan(
        rollout, valid, mini_batches=mini_batches, micro_batch=micro_batch, grad_accum=grad_accum,
        mode=mode, sp_size=sp.size if sp is not None else 1, device=next(engine.parameters()).device,
        by_tokens=by_tokens,
    )  # fmt: skip


def sequence_tokens(rollout: PackedRollout, valid: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Each sample's valid model-token count (0 for an invalid one; a tool's tokens never count), for the
    seq-mean modes when a rank holds only some columns of each sequence (sequence parallelism)."""
    return rollout.model_lens[start:end] * valid[start:end].to(torch.int64)
