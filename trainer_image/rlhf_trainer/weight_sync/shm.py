"""Shared-memory transport (same host): rank 0 packs each bucket straight into a /dev/shm file, engines map it.

The data never goes through a socket; a small gloo group carries only 'bucket ready' and 'bucket
consumed' signals. Two files alternate (double buffering), so rank 0 packs bucket i+1 while the
engines load bucket i; /dev/shm holds at most 2 x the largest bucket. Mappings stay open across
buckets and syncs, so only the first sync pays the page faults. Only for engines on the same host
as trainer rank 0.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from rlhf_trainer.weight_sync.bucketing import Bucket, dtype_from_name
from rlhf_trainer.weight_sync.gloo import open_gloo_group

SHM_DIR = Path(os.environ.get("RLHF_SHM_DIR", "/dev/shm"))
SLOTS = 2


class ShmChannel:
    def __init__(
        self, master_addr: str, master_port: int, rank: int, world_size: int, group_name: str
    ) -> None:
        self.rank = rank
        self.pg, self._store = open_gloo_group(
            master_addr, master_port, rank, world_size, group_name + "-ctl"
        )
        self.paths = [SHM_DIR / f"rlhf-weights-{group_name}-{slot}.bin" for slot in range(SLOTS)]
        if rank == 0:  # a run killed mid-sync leaves its files behind: never map stale bytes
            for path in self.paths:
                path.unlink(missing_ok=True)
        self._maps: dict[int, torch.Tensor] = {}  # slot -> uint8 view of its whole file
        self._consumed: dict[int, Any] = {}  # slot -> rank 0's pending 'consumed' allreduce
        self._ready = torch.zeros(1, dtype=torch.int64)
        self._signals = [torch.zeros(1, dtype=torch.int64) for _ in range(SLOTS)]

    def _view(self, slot: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        m = self._maps.get(slot)
        if m is None or m.numel() < nbytes:
            path = self.paths[slot]
            if self.rank == 0 and (not path.exists() or path.stat().st_size < nbytes):
                with path.open("ab") as f:
                    f.truncate(nbytes)
            m = torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)
            self._maps[slot] = m
        return m[:nbytes].view(dtype)

    def _free(self, slot: int) -> None:
        """Wait until every engine has loaded the bucket this file held before."""
        pending = self._consumed.pop(slot, None)
        if pending is not None:
            pending.wait()

    def staging(self, bucket: Bucket, index: int) -> torch.Tensor:
        self._free(index % SLOTS)
        return self._view(index % SLOTS, bucket.numel, dtype_from_name(bucket.dtype))

    def send(self, flat: torch.Tensor, index: int) -> None:
        slot = index % SLOTS
        self._free(slot)
        dst = self._view(slot, flat.numel(), flat.dtype)
        if dst.data_ptr() != flat.data_ptr():  # not packed in place by `staging`
            dst.copy_(flat)
        self._ready.fill_(index)
        self.pg.broadcast(self._ready, 0).wait()  # bucket ready
        # Not waited here: the engines load this bucket while the next one is packed into the other file.
        self._consumed[slot] = self.pg.allreduce([self._signals[slot]])

    def recv(self, bucket: Bucket, index: int) -> torch.Tensor:
        self.pg.broadcast(self._ready, 0).wait()
        if int(self._ready.item()) != index:
            raise RuntimeError(
                f"shm weight sync out of order: expected bucket {index}, got {int(self._ready.item())}"
            )
        return self._view(index % SLOTS, bucket.numel, dtype_from_name(bucket.dtype))

    def done_with(self, index: int) -> None:
        self.pg.allreduce([self._signals[index % SLOTS]]).wait()

    def close(self) -> None:
        # Pending 'consumed' signals are complete once the engines' receive calls returned (the driver
        # waits for them); never block here on a peer that may be gone.
        self._consumed.clear()
        self._maps.clear()
        if self.rank == 0:
            for path in self.paths:
                path.unlink(missing_ok=True)
