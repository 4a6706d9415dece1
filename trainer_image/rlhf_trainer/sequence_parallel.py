"""Ulysses sequence parallelism: a sequence split over the ranks of one group, heads swapped by all-to-all.

Owns the sequence-parallel (SP) groups (contiguous blocks of `trainer.sequenceParallelSize` ranks), the
differentiable all-to-all, and the attention function registered with transformers that runs full causal
attention on a subset of heads. It never moves rollout data: each rank of a group loads the group's
micro-batches itself and keeps only its slice of the activations.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

ATTENTION_NAME = "rlhf_ulysses"


@dataclass(frozen=True)
class SequenceParallel:
    """This rank's place: SP group `dp_rank` (= its data-parallel rank) of size `size`, position `rank` in it."""

    size: int
    rank: int
    dp_rank: int
    dp_size: int
    group: Any = None  # torch.distributed ProcessGroup of this rank's SP block

    @property
    def leader(self) -> bool:
        """The one rank of the group that reports results that are the same on every rank of it."""
        return self.rank == 0

    def columns(self, width: int) -> slice:
        """This rank's contiguous slice of a sequence padded to `width` (a multiple of size)."""
        step = width // self.size
        return slice(self.rank * step, (self.rank + 1) * step)


def init_groups(sp_size: int) -> SequenceParallel:
    """Create every SP block as a torch.distributed subgroup (collective: all ranks, same order)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % sp_size:
        raise ValueError(f"sequenceParallelSize {sp_size} does not divide the {world} ranks of this group")
    mine = None
    for first in range(0, world, sp_size):
        ranks = list(range(first, first + sp_size))
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    return SequenceParallel(sp_size, rank % sp_size, rank // sp_size, world // sp_size, mine)


def all_to_all(x: torch.Tensor, group: Any, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Split x into P pieces along scatter_dim, send piece j to rank j, concatenate the received pieces
    along gather_dim (in rank order). One `all_to_all_single`: gloo (CPU, checked on torch 2.13) and NCCL
    both implement it, so no rank ever holds the other ranks' full tensors."""
    size = dist.get_world_size(group)
    send = torch.stack([p.contiguous() for p in x.chunk(size, dim=scatter_dim)])
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    """all_to_all whose backward is the inverse all_to_all (gradients go back to the rank they came from)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, scatter_dim: int, gather_dim: int) -> torch.Tensor:
        ctx.group, ctx.scatter_dim, ctx.gather_dim = group, scatter_dim, gather_dim
        return all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return all_to_all(grads[0], ctx.group, ctx.gather_dim, ctx.scatter_dim), None, None, None


def seq_to_heads(x: torch.Tensor, group: Any) -> torch.Tensor:
    """[B, H, T/P, D] (all heads, my slice) -> [B, H/P, T, D] (my heads, whole sequence)."""
    out: torch.Tensor = _AllToAll.apply(x, group, 1, 2)  # type: ignore[no-untyped-call]
    return out


def heads_to_seq(x: torch.Tensor, group: Any) -> torch.Tensor:
    """[B, H/P, T, D] -> [B, H, T/P, D]: the inverse of seq_to_heads."""
    out: torch.Tensor = _AllToAll.apply(x, group, 2, 1)  # type: ignore[no-untyped-call]
    return out


def gather_columns(x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """[B, T/P] per-token results of each rank -> [B, T] on every rank of the SP group (small: one float a token)."""
    parts = [torch.empty_like(x) for _ in range(sp.size)]
    dist.all_gather(parts, x.contiguous(), group=sp.group)
    return torch.cat(parts, dim=1)


# ---- the attention function ------------------------------------------------------------------------


_ACTIVE: SequenceParallel | None = None


@contextlib.contextmanager
def forward_context(sp: SequenceParallel) -> Iterator[None]:
    """Within it, every Ulysses attention call exchanges heads over `sp`'s group."""
    global _ACTIVE
    previous, _ACTIVE = _ACTIVE, sp
    try:
        yield
    finally:
        _ACTIVE = previous


def ulysses_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention interface: q/k/v [B, heads, T/P, D] for this rank's slice -> [B, T/P, H, D].

    The mask is causal only: micro-batches are right-padded (`pad_micro_batch`, then up to a multiple of
    P), so a real token's causal window holds only real tokens and it never sees padding; padded
    positions compute garbage that no loss or result reads. `is_causal` (no explicit mask) lets SDPA use
    its flash kernel, which never materialises the [T, T] scores: the whole point at long sequences.
    """
    sp = _ACTIVE
    if sp is None:
        raise RuntimeError(
            f"attention '{ATTENTION_NAME}' called outside sequence_parallel.forward_context "
            "(a sequence-parallel model must be run through the trainer's forward helpers)"
        )
    q, k, v = (seq_to_heads(t, sp.group) for t in (query, key, value))
    groups = q.shape[1] // k.shape[1]
    if groups > 1:  # grouped-query attention: the same mapping as transformers' repeat_kv
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, dropout_p=dropout, is_causal=True, scale=scaling
    )
    return heads_to_seq(out, sp.group).transpose(1, 2).contiguous(), None


def register() -> str:
    """Register the Ulysses attention with transformers; returns its name. (transformers builds no mask
    for an attention it has no mask function for; the attention is causal by itself.)"""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, ulysses_attention)
    return ATTENTION_NAME


def enable(model: Any, sp: SequenceParallel | None) -> None:
    """Switch an HF model to Ulysses attention when this rank splits sequences (sp.size > 1)."""
    if sp is None or sp.size <= 1:
        return
    cfg = model.config
    heads = int(cfg.num_attention_heads)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
    if heads % sp.size or kv_heads % sp.size:  # also checked before start (rlhf_api.validate)
        raise ValueError(
            f"spec.trainer.sequenceParallelSize: {sp.size} must divide the model's attention heads "
            f"(num_attention_heads={heads}, num_key_value_heads={kv_heads})"
        )
    model.set_attn_implementation(register())
