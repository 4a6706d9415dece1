"""Delta weight sync's encoding: only the elements of a bucket that changed since the engines' copy.

With bf16 engines and RL's small learning rates most bf16 values do not change from one step to the
next (the fp32 master weights move by less than one bf16 step). A bucket is compared bit for bit with
the copy the engines hold (same dtype, same layout) and sent as whichever is smallest: the changed
elements' positions (as uint16 gaps) and values, a bitmask and the values, or the whole bucket. Applying a delta to the
engines' copy reproduces the new bucket exactly, so the engines stay bit-identical to the trainer's cast
weights. Pure torch, no transport (delta_wire.py sends it; benchmarks/delta_sync.py measures it).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal

import torch

Encoding = Literal["full", "gaps", "bitmask"]
GAP_DTYPE = torch.uint16  # positions travel as gaps between changed elements: 2 bytes each
MAX_GAP = 65535  # a longer run of unchanged elements gets a filler entry (its unchanged value) every MAX_GAP


@dataclass
class Delta:
    """One bucket's update. `full`: `values` is the whole bucket; `gaps`: the distance of each sent element
    from the previous one (the first from -1) and its value; `bitmask`: one bit per element (packed
    little-endian into uint8) and the values of the set bits. `changed`: elements that differ."""

    encoding: Encoding
    numel: int
    values: torch.Tensor
    gaps: torch.Tensor | None = None  # GAP_DTYPE, the `gaps` encoding's
    bitmask: torch.Tensor | None = None
    changed: int = 0

    @property
    def nbytes(self) -> int:
        """Bytes on the wire."""
        extra = self.gaps if self.gaps is not None else self.bitmask
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
    if mask.device.type == "cpu":  # numpy's packbits is one C pass
        import numpy as np

        return torch.from_numpy(np.packbits(mask.numpy(), bitorder="little"))
    n = mask.numel()
    padded = torch.zeros((n + 7) // 8 * 8, dtype=torch.uint8, device=mask.device)
    padded[:n] = mask.to(torch.uint8)
    weights = (2 ** torch.arange(8, dtype=torch.uint8, device=mask.device)).to(torch.uint8)
    return (padded.view(-1, 8) * weights).sum(dim=1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    if packed.device.type == "cpu":
        import numpy as np

        return torch.from_numpy(np.unpackbits(packed.numpy(), count=n, bitorder="little").view(bool))
    weights = (2 ** torch.arange(8, dtype=torch.uint8, device=packed.device)).to(torch.uint8)
    return ((packed.unsqueeze(1) & weights) != 0).reshape(-1)[:n]


def encoded_bytes(numel: int, changed: int, elem: int) -> tuple[int, int]:
    """Wire bytes of a bucket's delta with `changed` of its `numel` elements changed: as gaps (a filler per
    MAX_GAP unchanged elements at most) and as a bitmask."""
    gap_bytes = (changed + numel // MAX_GAP) * (elem + 2)
    return gap_bytes, (numel + 7) // 8 + changed * elem


def encode(new: torch.Tensor, old: torch.Tensor | None, full_above: float = 0.5) -> Delta:
    """The cheapest encoding of `new` for a receiver holding `old` (None: it holds nothing yet). A bucket
    whose delta would not be at most `full_above` of the full bucket's bytes goes whole, so a delta sync
    never sends more than a full one."""
    numel = new.numel()
    if old is None:
        return Delta("full", numel, new, changed=numel)
    mask = changed_mask(new, old)
    changed = int(torch.count_nonzero(mask))
    full_bytes = numel * new.element_size()
    gap_bytes, bitmask_bytes = encoded_bytes(numel, changed, new.element_size())
    if min(gap_bytes, bitmask_bytes) > full_above * full_bytes:
        return Delta("full", numel, new, changed=changed)
    if gap_bytes <= bitmask_bytes:
        pos = mask.nonzero().squeeze(1)
        gaps = torch.diff(pos, prepend=torch.full((1,), -1, dtype=pos.dtype, device=pos.device))
        if pos.numel() and int(gaps.max()) > MAX_GAP:  # a filler every MAX_GAP elements keeps gaps short
            filler = torch.arange(0, numel, MAX_GAP, dtype=pos.dtype, device=pos.device)
            pos = torch.unique(torch.cat([pos, filler]))
            gaps = torch.diff(pos, prepend=torch.full((1,), -1, dtype=pos.dtype, device=pos.device))
        return Delta("gaps", numel, new[pos], gaps=gaps.to(GAP_DTYPE), changed=changed)
    return Delta("bitmask", numel, new[mask], bitmask=pack_bits(mask), changed=changed)


WORK_PER_COMPARE = 4.0
"""A delta costs about four bit-compares of its bucket: the compare, `nonzero` or the bitmask, the gather
and the receiver's scatter (each measured alone on this machine's CPU for a 134M-element bf16 bucket:
0.113, 0.170, 0.173 and 0.34-0.44 s; docs/benchmarks.md, delta_sync.py)."""
SAMPLE = 64  # a bucket's first 1/64 is compared to price its delta: 1.6 % of one compare's cost
MIN_SAMPLE = 1 << 16  # elements: below, a call's fixed cost would dominate the sample's time
MAX_WINDOW = 512  # the longest run of syncs a bucket priced whole goes without being priced again


@dataclass
class DeltaEncoder:
    """`encode` per bucket across syncs, without paying the comparison where it does not pay. A bucket that
    went whole because too much changed is sent whole without comparing for the next `recheck_every - 1`
    syncs, then compared again. With `choose` "time" and the link's speed known (`observe_link`, from
    whole buckets sent), a bucket is first priced on a sample: if comparing and applying its delta
    (WORK_PER_COMPARE compares) would take longer than sending it whole, it goes whole, and is not priced
    again for a window of syncs that doubles each time the price says whole (up to MAX_WINDOW). So on a
    link as fast as memory a delta sync costs what a full one does, plus the samples. `changed` is -1 for
    a bucket sent without comparing."""

    full_above: float = 0.5
    recheck_every: int = 8
    choose: str = "bytes"  # "time" or "bytes" (weightSync.delta.choose)
    seconds_per_byte: float | None = None  # the link's, from whole buckets sent; None: unknown
    skip: dict[int, int] = field(default_factory=dict)  # bucket index -> syncs left to send it whole
    window: dict[int, int] = field(default_factory=dict)  # bucket index -> its next skip after a price

    def reset(self) -> None:
        """A new channel: no skips, no pricing windows, and the link measured afresh (maybe another one)."""
        self.skip.clear()
        self.window.clear()
        self.seconds_per_byte = None

    def observe_link(self, nbytes: int, seconds: float) -> None:
        """A whole bucket of `nbytes` took `seconds` to send: the link's speed (the latest, smoothed)."""
        if nbytes <= 0 or seconds <= 0:
            return
        now = seconds / nbytes
        self.seconds_per_byte = now if self.seconds_per_byte is None else 0.5 * (self.seconds_per_byte + now)

    def encode(self, index: int, new: torch.Tensor, old: torch.Tensor | None) -> Delta:
        left = self.skip.get(index, 0)
        if old is not None and left > 0:
            self.skip[index] = left - 1
            return Delta("full", new.numel(), new, changed=-1)
        if old is not None and self.choose == "time" and not self.pays(new, old):
            window = self.window.get(index, self.recheck_every)
            self.skip[index] = window - 1
            self.window[index] = min(2 * window, MAX_WINDOW)
            return Delta("full", new.numel(), new, changed=-1)
        out = encode(new, old, self.full_above)
        if out.encoding == "full" and old is not None:
            self.skip[index] = self.recheck_every - 1
        elif out.encoding != "full":
            self.window.pop(index, None)  # a delta paid: price it afresh next time
        return out

    def pays(self, new: torch.Tensor, old: torch.Tensor) -> bool:
        """Whether the delta of `new` should take less time than sending it whole, from the link's speed
        and a compare of the bucket's first 1/SAMPLE (at least MIN_SAMPLE elements): its time and the share
        that changed. Unknown link: yes (bytes decide)."""
        if self.seconds_per_byte is None:
            return True
        numel, elem = new.numel(), new.element_size()
        k = min(numel, max(numel // SAMPLE, MIN_SAMPLE))  # a small bucket whole: no overhead scaled up
        t0 = time.perf_counter()
        changed = int(torch.count_nonzero(changed_mask(new[:k], old[:k])))
        compare = (time.perf_counter() - t0) * numel / k
        delta_bytes = min(encoded_bytes(numel, round(changed / k * numel), elem))
        return (
            WORK_PER_COMPARE * compare + delta_bytes * self.seconds_per_byte
            < numel * elem * self.seconds_per_byte
        )


def apply(delta: Delta, held: torch.Tensor) -> torch.Tensor:
    """The receiver's copy after the delta (in place for deltas; the values themselves for `full`)."""
    if held.numel() != delta.numel:
        raise ValueError(f"delta for {delta.numel} elements applied to a bucket of {held.numel()}")
    if delta.encoding == "full":
        held.copy_(delta.values)
    elif delta.encoding == "gaps":
        assert delta.gaps is not None
        pos = torch.cumsum(delta.gaps.to(torch.int64), 0) - 1
        held[pos] = delta.values
    else:
        assert delta.bitmask is not None
        held.masked_scatter_(unpack_bits(delta.bitmask, delta.numel).to(held.device), delta.values)
    return held


def digest(t: torch.Tensor) -> int:
    """A cheap order-sensitive checksum of a bucket's bits (int64 wrap-around sum of bits x position), to
    compare the engines' copy with the trainer's without sending it back."""
    bits = _bits(t).to(torch.int64)
    pos = torch.arange(1, bits.numel() + 1, dtype=torch.int64, device=t.device)
    return int((bits * pos).sum())
