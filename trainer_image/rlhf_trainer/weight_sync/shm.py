"""Shared-memory transport (same host): rank 0 writes each bucket into a /dev/shm file, engines map it.

The data never goes through a socket; a small gloo group carries only 'bucket ready' and 'bucket
consumed' signals. Only for engines on the same host as trainer rank 0.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from rlhf_trainer.weight_sync.bucketing import Bucket, dtype_from_name
from rlhf_trainer.weight_sync.gloo import open_gloo_group

SHM_DIR = Path(os.environ.get("RLHF_SHM_DIR", "/dev/shm"))


class ShmChannel:
    def __init__(
        self, master_addr: str, master_port: int, rank: int, world_size: int, group_name: str
    ) -> None:
        self.rank = rank
        self.pg, self._store = open_gloo_group(
            master_addr, master_port, rank, world_size, group_name + "-ctl"
        )
        self.path = SHM_DIR / f"rlhf-weights-{group_name}.bin"
        if rank == 0:  # a run killed mid-sync leaves its file behind: never map stale bytes
            self.path.unlink(missing_ok=True)
        self._signal = torch.zeros(1, dtype=torch.int64)

    def _map(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if self.rank == 0 and (not self.path.exists() or self.path.stat().st_size < nbytes):
            with self.path.open("ab") as f:
                f.truncate(nbytes)
        return torch.from_file(str(self.path), shared=True, size=numel, dtype=dtype)

    def send(self, flat: torch.Tensor, index: int) -> None:
        self._map(flat.numel(), flat.dtype).copy_(flat)
        self._signal.fill_(index)
        self.pg.broadcast(self._signal, 0).wait()  # bucket ready
        self.pg.allreduce([self._signal]).wait()  # every engine has loaded it: the file may be reused

    def recv(self, bucket: Bucket, index: int) -> torch.Tensor:
        self.pg.broadcast(self._signal, 0).wait()
        if int(self._signal.item()) != index:
            raise RuntimeError(
                f"shm weight sync out of order: expected bucket {index}, got {int(self._signal.item())}"
            )
        return self._map(bucket.numel, dtype_from_name(bucket.dtype))

    def done_with(self, index: int) -> None:
        self._signal.fill_(index)
        self.pg.allreduce([self._signal]).wait()

    def close(self) -> None:
        if self.rank == 0:
            self.path.unlink(missing_ok=True)
