"""The one choice of weight-sync transport (rlhf_trainer.weight_sync.manager.choose_backend), pure."""

from __future__ import annotations

import pytest
from rlhf_trainer.device import DeviceInfo
from rlhf_trainer.weight_sync.manager import choose_backend

pytestmark = pytest.mark.unit

CPU = DeviceInfo("cpu", "gloo")
GPU = DeviceInfo("cuda", "nccl")


def test_auto_on_cpu_uses_shm_only_when_every_engine_shares_the_senders_node() -> None:
    assert choose_backend("auto", CPU, sender_node="n0", engine_nodes=["n0", "n0"]) == "shm"
    assert choose_backend("auto", CPU, sender_node="n0", engine_nodes=["n0", "n1"]) == "gloo"  # sockets
    assert choose_backend("auto", CPU, sender_node="n0", engine_nodes=[]) == "gloo"  # the portable one
    assert choose_backend("auto", CPU) == "gloo"  # nodes not known yet


def test_auto_on_gpu_is_nccl_or_cuda_ipc_when_every_model_shares_the_engines_devices() -> None:
    assert choose_backend("auto", GPU) == "nccl"
    assert choose_backend("auto", GPU, colocate_all=True) == "cuda_ipc"
    assert choose_backend("auto", CPU, colocate_all=True) == "gloo"  # no CUDA IPC without CUDA


def test_an_explicit_backend_is_kept() -> None:
    assert choose_backend("gloo", CPU, sender_node="n0", engine_nodes=["n0"]) == "gloo"
    assert choose_backend("shm", CPU, sender_node="n0", engine_nodes=["n1"]) == "shm"
    assert choose_backend("nccl", GPU, colocate_all=True) == "nccl"


def test_gpu_only_backends_fail_on_cpu() -> None:
    with pytest.raises(ValueError, match="needs CUDA"):
        choose_backend("nccl", CPU)
    with pytest.raises(ValueError, match="needs CUDA"):
        choose_backend("cuda_ipc", CPU)
