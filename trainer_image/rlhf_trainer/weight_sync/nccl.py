"""NCCL transport (GPU): trainer rank 0 and every engine worker in a stateless NCCL communicator.

Built on vLLM's StatelessProcessGroup + PyNcclCommunicator so it never joins torch.distributed's
default group (which belongs to DeepSpeed on the trainer and to vLLM on the engines). Not exercised on CPU.
"""

from __future__ import annotations

import torch

from rlhf_trainer.weight_sync.bucketing import Bucket, StagingBuffer, dtype_from_name


class NcclChannel:
    def __init__(
        self, master_addr: str, master_port: int, rank: int, world_size: int, group_name: str
    ) -> None:
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        del group_name
        self.rank = rank
        self.device = torch.device("cuda", torch.cuda.current_device())
        pg = StatelessProcessGroup.create(
            host=master_addr, port=master_port, rank=rank, world_size=world_size
        )
        self.comm = PyNcclCommunicator(pg, device=self.device)
        self._buffer = StagingBuffer(self.device)  # packed on the GPU: no host round trip

    def staging(self, bucket: Bucket, index: int) -> torch.Tensor:
        del index
        return self._buffer.get(bucket.numel, dtype_from_name(bucket.dtype))

    def send(self, flat: torch.Tensor, index: int) -> None:
        del index
        self.comm.broadcast(
            flat.to(self.device, non_blocking=True), src=0, stream=torch.cuda.current_stream()
        )
        torch.cuda.current_stream().synchronize()

    def recv(self, bucket: Bucket, index: int) -> torch.Tensor:
        del index
        flat = self._buffer.get(bucket.numel, dtype_from_name(bucket.dtype))
        self.comm.broadcast(flat, src=0, stream=torch.cuda.current_stream())
        torch.cuda.current_stream().synchronize()
        return flat

    def done_with(self, index: int) -> None:
        del index

    def close(self) -> None:
        self.comm = None  # type: ignore[assignment]
