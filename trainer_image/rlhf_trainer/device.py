"""The device a job's processes compute on, from the job (never from the head's hardware), and the rank-side
check that a process sees the GPUs it was promised.

Every RLHFJob's trainer and rollout pods ask for GPUs, so every process computes on CUDA with NCCL, unless
the cluster runs the named CPU stand-in (`RLHF_GPU_STANDIN=cpu`, the chart's `jobDefaults.gpuStandIn`):
GPUs advertised but not real, placed as Ray's logical GPUs exactly as real ones, computed on with CPU
kernels and gloo. Owns that decision and the per-process environment; must be imported (and
`configure_process` called) before DeepSpeed is imported in a worker. Never falls back to CPU silently.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rlhf_api.constants import GPU_STANDIN_ENV

from rlhf_trainer.stacks import nccl

STANDIN_ENV = GPU_STANDIN_ENV
STANDINS = ("cpu",)


class DeviceError(ValueError):
    """The device setting is wrong, or a process does not see the GPUs it was promised."""


@dataclass(frozen=True)
class DeviceInfo:
    kind: str  # "cuda" or "cpu"
    dist_backend: str  # "nccl" or "gloo"

    @property
    def is_cpu(self) -> bool:
        return self.kind == "cpu"


def for_job(env: Mapping[str, str]) -> DeviceInfo:
    """CUDA and NCCL (the job asked for GPUs), or the CPU stand-in when `RLHF_GPU_STANDIN=cpu` says so."""
    standin = env.get(STANDIN_ENV, "")
    if standin == "cpu":
        return DeviceInfo("cpu", "gloo")
    if standin:
        raise DeviceError(f"{STANDIN_ENV}={standin!r}: the only GPU stand-in is 'cpu' (or unset: real GPUs)")
    return DeviceInfo("cuda", "nccl")


def describe(info: DeviceInfo) -> str:
    """One line for the driver's log: what computes, and whether it is the stand-in."""
    if info.is_cpu:
        return f"device: CPU stand-in for GPUs ({STANDIN_ENV}=cpu): Ray's logical GPUs placed, CPU kernels and gloo"
    return "device: cuda (the job's GPUs), torch.distributed nccl"


def whereabouts(kind: str, who: str) -> dict[str, Any]:
    """Where this process runs (pod, Ray node, Ray's GPU ids) and, for a CUDA process, whether it sees
    the GPUs Ray gave it: `problem` holds the job's failure message (pod, process, expected, seen)."""
    import ray

    ids = [int(g) for g in ray.get_gpu_ids()]
    pod = os.environ.get("HOSTNAME") or socket.gethostname()
    out: dict[str, Any] = {
        "pod": pod,
        "node_id": ray.get_runtime_context().get_node_id(),
        "gpus": ids,
        "pid": os.getpid(),
    }
    if (
        kind == "cuda" and ids
    ):  # a process given no GPU (a TP engine's actor) leaves the check to vLLM's workers
        try:
            import torch

            seen = torch.cuda.device_count() if torch.cuda.is_available() else 0
        except Exception:  # a broken CUDA install reads as no device, with the reason in the message
            seen = 0
        if seen < len(ids):
            out["problem"] = (
                f"{who} on pod {pod} was promised {len(ids)} GPU(s) (Ray GPU ids {ids}) but sees "
                f"{seen} CUDA device(s) (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}): "
                f"check the node's GPU driver and device plugin, or run the CPU stand-in ({STANDIN_ENV}=cpu) "
                "on a cluster whose GPUs are not real"
            )
    return out


def configure_process(info: DeviceInfo, threads: int | None = None) -> None:
    """Environment every worker process sets before importing DeepSpeed/vLLM."""
    if info.is_cpu:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        os.environ.setdefault("RLHF_DEVICE", "cpu")
    else:
        nccl.apply_defaults()  # the flight recorder and NCCL's transport lines (stacks.nccl)
    if threads:
        os.environ["OMP_NUM_THREADS"] = str(threads)
        try:
            import torch

            torch.set_num_threads(threads)
        except Exception:
            pass
