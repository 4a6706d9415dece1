"""gloo transport: a process group of (trainer rank 0, every engine worker) over its own TCPStore.

Each bucket is one broadcast from rank 0 to all engines at once. The group is separate from the
trainer's default (DeepSpeed) group and never touches torch.distributed's global state.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

from rlhf_trainer.weight_sync.bucketing import Bucket, StagingBuffer, dtype_from_name


def open_gloo_group(
    master_addr: str, master_port: int, rank: int, world_size: int, group_name: str, timeout_s: float = 600.0
) -> tuple[Any, Any]:
    """A gloo group over its own TCPStore; returns (group, store): keep the store alive with the group."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(  # type: ignore[attr-defined]
        master_addr, master_port, world_size, is_master=(rank == 0), timeout=timeout, wait_for_workers=False
    )
    prefixed = dist.PrefixStore(group_name, store)  # type: ignore[attr-defined]
    pg = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    return pg, store


class GlooChannel:
    """Rank 0 sends, every other rank receives, one broadcast per bucket."""

    def __init__(
        self, master_addr: str, master_port: int, rank: int, world_size: int, group_name: str
    ) -> None:
        self.rank = rank
        self.pg, self._store = open_gloo_group(master_addr, master_port, rank, world_size, group_name)
        self._buffer = StagingBuffer()  # broadcasts are synchronous: one bucket in flight at a time

    def staging(self, bucket: Bucket, index: int) -> torch.Tensor:
        del index
        return self._buffer.get(bucket.numel, dtype_from_name(bucket.dtype))

    def send(self, flat: torch.Tensor, index: int) -> None:
        del index
        self.pg.broadcast(flat, 0).wait()

    def recv(self, bucket: Bucket, index: int) -> torch.Tensor:
        del index  # the engine has loaded the previous bucket's view before it asks for the next
        flat = self._buffer.get(bucket.numel, dtype_from_name(bucket.dtype))
        self.pg.broadcast(flat, 0).wait()
        return flat

    def done_with(self, index: int) -> None:
        del index

    def close(self) -> None:
        self.pg = None  # type: ignore[assignment]
