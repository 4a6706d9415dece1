"""Device and backend detection: cuda -> nccl, otherwise cpu -> gloo (and DS_ACCELERATOR=cpu).

Owns the one place that decides device and torch.distributed backend (the weight-sync backend is
weight_sync.manager.choose_backend). Must be imported (and `configure_process` called) before DeepSpeed
is imported in a worker.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceInfo:
    kind: str  # "cuda" or "cpu"
    dist_backend: str  # "nccl" or "gloo"

    @property
    def is_cpu(self) -> bool:
        return self.kind == "cpu"


def detect() -> DeviceInfo:
    forced = os.environ.get("RLHF_DEVICE")
    if forced == "cpu":
        return DeviceInfo("cpu", "gloo")
    try:
        import torch

        has_cuda = torch.cuda.is_available() and torch.cuda.device_count() > 0
    except Exception:
        has_cuda = False
    if has_cuda and forced != "cpu":
        return DeviceInfo("cuda", "nccl")
    return DeviceInfo("cpu", "gloo")


def configure_process(info: DeviceInfo, threads: int | None = None) -> None:
    """Environment every worker process sets before importing DeepSpeed/vLLM."""
    if info.is_cpu:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        os.environ.setdefault("RLHF_DEVICE", "cpu")
    if threads:
        os.environ["OMP_NUM_THREADS"] = str(threads)
        try:
            import torch

            torch.set_num_threads(threads)
        except Exception:
            pass
