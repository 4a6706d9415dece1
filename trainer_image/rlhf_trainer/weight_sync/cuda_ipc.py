"""CUDA IPC transport (GPU, engines colocated with trainer rank 0): share each bucket's device memory.

Rank 0 publishes a CUDA IPC handle per bucket through a stateless store-backed group; engines map it,
load, and signal done before rank 0 frees the bucket. Not exercised on CPU.
"""

from __future__ import annotations

from typing import Any

import torch

from rlhf_trainer.weight_sync.bucketing import Bucket, dtype_from_name


class CudaIpcChannel:
    def __init__(
        self, master_addr: str, master_port: int, rank: int, world_size: int, group_name: str
    ) -> None:
        from vllm.distributed.utils import StatelessProcessGroup

        del group_name
        self.rank = rank
        self.pg = StatelessProcessGroup.create(
            host=master_addr, port=master_port, rank=rank, world_size=world_size
        )
        self._held: torch.Tensor | None = None

    def staging(self, bucket: Bucket, index: int) -> torch.Tensor:
        del index  # a fresh device buffer: engines map it by handle, so it must not be reused under them
        return torch.empty(bucket.numel, dtype=dtype_from_name(bucket.dtype), device="cuda")

    def send(self, flat: torch.Tensor, index: int) -> None:
        from torch.multiprocessing.reductions import reduce_tensor

        self._held = flat.cuda()
        torch.cuda.current_stream().synchronize()
        self.pg.broadcast_obj((index, reduce_tensor(self._held)), src=0)  # type: ignore[no-untyped-call]
        self.pg.barrier()  # every engine loaded it
        self._held = None

    def recv(self, bucket: Bucket, index: int) -> torch.Tensor:
        got_index, (rebuild, args) = self.pg.broadcast_obj(None, src=0)
        if got_index != index:
            raise RuntimeError(f"cuda_ipc weight sync out of order: expected {index}, got {got_index}")
        call_args: list[Any] = list(args)
        call_args[6] = torch.cuda.current_device()  # the device index as this process numbers it
        tensor: torch.Tensor = rebuild(*call_args)
        del bucket
        return tensor

    def done_with(self, index: int) -> None:
        del index
        self.pg.barrier()

    def close(self) -> None:
        self.pg = None  # type: ignore[assignment]
