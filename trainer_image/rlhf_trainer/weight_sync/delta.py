"""Delta weight sync's encoding: only the elements of a bucket that changed since the engines' copy.

With bf16 engines and RL's small learning rates most bf16 values do not change from one step to the
next (the fp32 master weights move by less than one bf16 step). A bucket is compared bit for bit with
the copy the engines hold (same dtype, same layout) and sent as whichever is smallest: the changed
elements' indices and values, a bitmask and the values, or the whole bucket. Applying a delta to the
engines' copy reproduces the new bucket exactly, so the engines stay bit-identical to the trainer's cast
weights. Pure torch, no transport: benchmarks/delta_sync.py measures it; wiring into the sync is
issue 39's next step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Encoding = Literal["full", "indices", "bitmask"]
INDEX_DTYPE = torch.int32  # buckets are far below 2^31 elements


@dataclass
class Delta:
    """One bucket's update. `full`: `values` is the whole bucket; `indices`: positions and their new values;
    `bitmask`: one bit per element (packed little-endian into uint8) and the values of the set bits."""

    encoding: Encoding
    numel: int
    values: torch.Tensor
    indices: torch.Tensor | None = None
    bitmask: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        """Bytes on the wire."""
        extra = self.indices if self.indices is not None else self.bitmask
        size = self.values.numel() * self.values.element_size()
        return size + (extra.numel() * extra.element_size() if extra is not None else 0)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bits as integers of its width (so -0.0 != 0.0 and NaN == NaN bitwise)."""
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.contiguous().view(width)


def changed_mask(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """Elements whose bits differ (flat buckets of one dtype)."""
    if new.shape != old.shape or new.dtype != old.dtype:
        raise ValueError(
            f"bucket changed layout: {tuple(new.shape)}/{new.dtype} vs {tuple(old.shape)}/{old.dtype}"
        )
    return _bits(new) != _bits(old)


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """A bool vector as bytes, 8 elements each, element i in bit i % 8 of byte i // 8."""
    n = mask.numel()
    padded = torch.zeros((n + 7) // 8 * 8, dtype=torch.uint8, device=mask.device)
    padded[:n] = mask.to(torch.uint8)
    weights = (2 ** torch.arange(8, dtype=torch.uint8, device=mask.device)).to(torch.uint8)
    return (padded.view(-1, 8) * weights).sum(dim=1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    weights = (2 ** torch.arange(8, dtype=torch.uint8, device=packed.device)).to(torch.uint8)
    return ((packed.unsqueeze(1) & weights) != 0).reshape(-1)[:n]


def encode(new: torch.Tensor, old: torch.Tensor | None, full_above: float = 0.5) -> Delta:
    """The cheapest encoding of `new` for a receiver holding `old` (None: it holds nothing yet). A bucket
    whose delta would not be at most `full_above` of the full bucket's bytes goes whole, so a delta sync
    never sends more than a full one."""
    numel = new.numel()
    if old is None:
        return Delta("full", numel, new)
    mask = changed_mask(new, old)
    changed = int(mask.sum())
    elem = new.element_size()
    full_bytes = numel * elem
    index_bytes = changed * (elem + torch.empty((), dtype=INDEX_DTYPE).element_size())
    bitmask_bytes = (numel + 7) // 8 + changed * elem
    if min(index_bytes, bitmask_bytes) > full_above * full_bytes:
        return Delta("full", numel, new)
    if index_bytes <= bitmask_bytes:
        idx = mask.nonzero().squeeze(1)
        return Delta("indices", numel, new[idx], indices=idx.to(INDEX_DTYPE))
    return Delta("bitmask", numel, new[mask], bitmask=pack_bits(mask))


def apply(delta: Delta, held: torch.Tensor) -> torch.Tensor:
    """The receiver's copy after the delta (in place for deltas; the values themselves for `full`)."""
    if held.numel() != delta.numel:
        raise ValueError(f"delta for {delta.numel} elements applied to a bucket of {held.numel()}")
    if delta.encoding == "full":
        held.copy_(delta.values)
    elif delta.encoding == "indices":
        assert delta.indices is not None
        held[delta.indices.long()] = delta.values
    else:
        assert delta.bitmask is not None
        held[unpack_bits(delta.bitmask, delta.numel)] = delta.values
    return held


def digest(t: torch.Tensor) -> int:
    """A cheap order-sensitive checksum of a bucket's bits (int64 wrap-around sum of bits x position), to
    compare the engines' copy with the trainer's without sending it back."""
    bits = _bits(t).to(torch.int64)
    pos = torch.arange(1, bits.numel() + 1, dtype=torch.int64, device=t.device)
    return int((bits * pos).sum())
