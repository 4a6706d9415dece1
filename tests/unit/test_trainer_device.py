"""Device detection's choices of weight-sync transport, as pure functions."""

from __future__ import annotations

import pytest
from rlhf_trainer import device

pytestmark = pytest.mark.unit

CPU = device.DeviceInfo("cpu", "gloo", "gloo")
GPU = device.DeviceInfo("cuda", "nccl", "nccl")


def test_auto_on_cpu_uses_shm_only_when_every_engine_shares_the_senders_node() -> None:
    assert device.cpu_channel_for("auto", "n0", ["n0", "n0"]) == "shm"
    assert device.cpu_channel_for("auto", "n0", ["n0", "n1"]) == "gloo"  # one remote engine: sockets
    assert device.cpu_channel_for("auto", "n0", []) == "gloo"  # no engine known: the portable one


def test_an_explicit_backend_is_kept() -> None:
    assert device.cpu_channel_for("gloo", "n0", ["n0"]) == "gloo"
    assert device.cpu_channel_for("shm", "n0", ["n1"]) == "shm"


def test_auto_follows_the_device_and_gpu_only_backends_fail_on_cpu() -> None:
    assert device.resolve_weight_sync_backend("auto", CPU) == "gloo"
    assert device.resolve_weight_sync_backend("auto", GPU) == "nccl"
    with pytest.raises(ValueError, match="needs CUDA"):
        device.resolve_weight_sync_backend("nccl", CPU)
    with pytest.raises(ValueError, match="needs CUDA"):
        device.resolve_weight_sync_backend("cuda_ipc", CPU)
