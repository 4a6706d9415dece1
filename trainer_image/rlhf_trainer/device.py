"""Device and backend detection: cuda -> nccl, otherwise cpu -> gloo (and DS_ACCELERATOR=cpu).

Owns the one place that decides device, torch.distributed backend and the default weight-sync
backend. Must be imported (and `configure_process` called) before DeepSpeed is imported in a worker.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceInfo:
    kind: str  # "cuda" or "cpu"
    dist_backend: str  # "nccl" or "gloo"
    weight_sync_backend: str  # default for weightSync.backend == "auto"

    @property
    def is_cpu(self) -> bool:
        return self.kind == "cpu"


def detect() -> DeviceInfo:
    forced = os.environ.get("RLHF_DEVICE")
    if forced == "cpu":
        return DeviceInfo("cpu", "gloo", "gloo")
    try:
        import torch

        has_cuda = torch.cuda.is_available() and torch.cuda.device_count() > 0
    except Exception:
        has_cuda = False
    if has_cuda and forced != "cpu":
        return DeviceInfo("cuda", "nccl", "nccl")
    return DeviceInfo("cpu", "gloo", "gloo")


def cpu_channel_for(requested: str, sender_node: str, engine_nodes: list[str]) -> str:
    """`auto` on CPU: shm when every engine shares the sender's Ray node (one pod, one /dev/shm), else gloo.

    benchmarks/weight_sync.py: on one host shm moves the weights 2-3x faster than gloo's loopback TCP.
    """
    if requested not in ("", "auto", None):
        return requested
    return "shm" if engine_nodes and all(n == sender_node for n in engine_nodes) else "gloo"


def resolve_weight_sync_backend(requested: str, info: DeviceInfo) -> str:
    """Map weightSync.backend (auto|nccl|gloo|cuda_ipc|shm) to one usable on this device."""
    if requested in ("", "auto", None):
        return info.weight_sync_backend
    if requested in ("nccl", "cuda_ipc") and info.is_cpu:
        raise ValueError(
            f"weightSync.backend={requested} needs CUDA; this process sees no GPU (use gloo or shm)"
        )
    return requested


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
