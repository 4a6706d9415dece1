"""The registry of weight transports behind one API: staging / send(flat, i) / recv(bucket, i) / done_with(i).

Owns only the name -> class mapping and the rendezvous record; each backend module owns its wire.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Protocol

import torch

from rlhf_trainer.weight_sync.bucketing import Bucket


class WeightChannel(Protocol):
    rank: int

    def staging(self, bucket: Bucket, index: int) -> torch.Tensor:
        """Where the sender packs bucket `index` (its transport's own memory when it has some), so
        `send` moves it without another copy."""
        ...

    def send(self, flat: torch.Tensor, index: int) -> None: ...
    def recv(self, bucket: Bucket, index: int) -> torch.Tensor: ...
    def done_with(self, index: int) -> None: ...
    def close(self) -> None: ...


@dataclass(frozen=True)
class Rendezvous:
    """Where the weight-sync group meets; rank 0 is the trainer, engines take ranks 1..world_size-1."""

    backend: str
    master_addr: str
    master_port: int
    world_size: int
    group_name: str

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> Rendezvous:
        return cls(**wire)


def open_channel(rdzv: Rendezvous, rank: int) -> WeightChannel:
    args = (rdzv.master_addr, rdzv.master_port, rank, rdzv.world_size, rdzv.group_name)
    if rdzv.backend == "gloo":
        from rlhf_trainer.weight_sync.gloo import GlooChannel

        return GlooChannel(*args)
    if rdzv.backend == "shm":
        from rlhf_trainer.weight_sync.shm import ShmChannel

        return ShmChannel(*args)
    if rdzv.backend == "nccl":
        from rlhf_trainer.weight_sync.nccl import NcclChannel

        return NcclChannel(*args)
    if rdzv.backend == "cuda_ipc":
        from rlhf_trainer.weight_sync.cuda_ipc import CudaIpcChannel

        return CudaIpcChannel(*args)
    raise ValueError(f"unknown weightSync.backend {rdzv.backend!r} (auto, nccl, gloo, cuda_ipc, shm)")
