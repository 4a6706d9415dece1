"""The bucket plan of a weight sync: parameters grouped into flat, same-dtype buckets of bounded MiB.

Pure: plans, packs and unpacks tensors; knows nothing of ZeRO, Ray, vLLM or any transport. A plan is
plain data (lists/str/int) so it crosses RPC boundaries (vLLM's collective_rpc turns tensors into lists).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    # the delta sync's frames: a header of int64 and a payload of bytes
    "int64": torch.int64,
    "uint8": torch.uint8,
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    return _DTYPES[name]


@dataclass(frozen=True)
class ParamSlot:
    """One parameter inside a bucket: its HF name, shape, and element offset in the flat buffer."""

    name: str
    shape: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class Bucket:
    dtype: str
    slots: list[ParamSlot] = field(default_factory=list)

    @property
    def numel(self) -> int:
        return sum(s.numel for s in self.slots)

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=dtype_from_name(self.dtype)).element_size()

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.slots]


def plan_buckets(params: Iterable[tuple[str, Sequence[int], torch.dtype]], bucket_bytes: int) -> list[Bucket]:
    """Group (name, shape, dtype) in order into same-dtype buckets of at most bucket_bytes.

    A parameter larger than bucket_bytes gets a bucket of its own (it cannot be split: vLLM's loaders
    take whole tensors). Order is kept within a dtype so the plan is deterministic on every rank.
    """
    if bucket_bytes <= 0:
        raise ValueError("bucket_bytes must be positive")
    open_buckets: dict[str, Bucket] = {}
    done: list[Bucket] = []
    for name, shape, dtype in params:
        dname = dtype_name(dtype)
        elem = torch.empty((), dtype=dtype).element_size()
        numel = math.prod(shape)
        bucket = open_buckets.get(dname)
        if bucket is not None and bucket.slots and (bucket.numel + numel) * elem > bucket_bytes:
            done.append(bucket)
            bucket = None
        if bucket is None:
            bucket = Bucket(dtype=dname)
            open_buckets[dname] = bucket
        bucket.slots.append(ParamSlot(name=name, shape=tuple(int(d) for d in shape), offset=bucket.numel))
    done.extend(b for b in open_buckets.values() if b.slots)
    return done


def pack_bucket(
    bucket: Bucket, tensors: Sequence[torch.Tensor], out: torch.Tensor | None = None
) -> torch.Tensor:
    """Copy tensors (in slot order) into one flat buffer of the bucket's dtype."""
    flat = out if out is not None else torch.empty(bucket.numel, dtype=dtype_from_name(bucket.dtype))
    if len(tensors) != len(bucket.slots):
        raise ValueError(f"bucket has {len(bucket.slots)} slots, got {len(tensors)} tensors")
    for slot, t in zip(bucket.slots, tensors, strict=True):
        if tuple(t.shape) != slot.shape:
            raise ValueError(f"{slot.name}: shape {tuple(t.shape)} does not match plan {slot.shape}")
        flat[slot.offset : slot.offset + slot.numel].copy_(t.reshape(-1))
    return flat


class StagingBuffer:
    """One flat buffer per dtype, grown to the largest bucket and reused for every bucket and sync.

    A fresh buffer per bucket costs a page fault per 4 KiB on first touch (most of `pack` on CPU); the
    caller must be done with one bucket's view before asking for the next.
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._buffers: dict[torch.dtype, torch.Tensor] = {}

    def get(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        buf = self._buffers.get(dtype)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype, device=self.device)
            self._buffers[dtype] = buf
        return buf[:numel]


def unpack_bucket(bucket: Bucket, flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Views of the flat buffer as (name, tensor) pairs, ready for a model's load_weights."""
    return [(s.name, flat[s.offset : s.offset + s.numel].view(s.shape)) for s in bucket.slots]


def plan_to_wire(plan: list[Bucket]) -> list[dict[str, Any]]:
    return [{"dtype": b.dtype, "slots": [asdict(s) for s in b.slots]} for b in plan]


def plan_from_wire(wire: list[dict[str, Any]]) -> list[Bucket]:
    return [
        Bucket(
            dtype=b["dtype"],
            slots=[
                ParamSlot(name=s["name"], shape=tuple(s["shape"]), offset=int(s["offset"]))
                for s in b["slots"]
            ],
        )
        for b in wire
    ]


def plan_bytes(plan: list[Bucket]) -> int:
    return sum(b.nbytes for b in plan)
