"""vLLM worker extension (`worker_extension_cls`): the engine side of a weight sync.

Runs inside each vLLM worker process, reached through `LLM.collective_rpc`. It joins the weight-sync
group, receives every bucket of a plan once, loads it with the model's own `load_weights`, and on CPU
re-runs the linear-weight packing. Control arguments are plain data only (tensors arrive as lists).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from rlhf_trainer.weight_sync.bucketing import plan_from_wire, unpack_bucket
from rlhf_trainer.weight_sync.channels import Rendezvous, WeightChannel, open_channel
from rlhf_trainer.weight_sync.delta import digest
from rlhf_trainer.weight_sync.delta_wire import DeltaReceiver


class RLHFWorkerExtension:
    """Mixed into vLLM's worker class; `self` is the worker (has model_runner, rank)."""

    _rlhf_channel: WeightChannel | None = None
    _rlhf_delta: DeltaReceiver | None = None  # weightSync.delta: this worker's copy of every bucket

    def _rlhf_model(self) -> torch.nn.Module:
        return self.model_runner.get_model()  # type: ignore[attr-defined, no-any-return]

    def rlhf_open_weight_channel(self, rdzv_wire: dict[str, Any], rank_offset: int) -> int:
        rdzv = Rendezvous.from_wire(rdzv_wire)
        tp_rank = int(getattr(self, "rank", 0))
        rank = rank_offset + tp_rank
        self._rlhf_channel = open_channel(rdzv, rank)
        self._rlhf_delta = None  # a new channel starts from a full sync
        return rank

    def rlhf_close_weight_channel(self) -> None:
        if self._rlhf_channel is not None:
            self._rlhf_channel.close()
        self._rlhf_channel = None

    def rlhf_receive_weights(
        self, plan_wire: list[dict[str, Any]], delta_wire: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """Every bucket of the plan, whole or (`delta_wire`, weightSync.delta on: {verify, drop}) as
        frames applied to this worker's copy. `verify`: the digest of every bucket as loaded. `drop`
        (fault injection) discards the first delta frame, as a lost one would be."""
        channel = self._rlhf_channel
        if channel is None:
            raise RuntimeError("weight sync: rlhf_open_weight_channel was not called on this engine")
        model = self._rlhf_model()
        t0 = time.perf_counter()
        loaded = 0
        nbytes = 0
        digests: list[int] = []
        dropped = 0
        verify = bool(delta_wire and delta_wire.get("verify"))
        drop = bool(delta_wire and delta_wire.get("drop"))
        if delta_wire is not None and self._rlhf_delta is None:
            self._rlhf_delta = DeltaReceiver()
        for index, bucket in enumerate(plan_from_wire(plan_wire)):
            if self._rlhf_delta is None:
                flat = channel.recv(bucket, index)
                model.load_weights(unpack_bucket(bucket, flat))  # type: ignore[operator]
                channel.done_with(index)
                nbytes += flat.numel() * flat.element_size()  # what arrived, not what the plan says
            else:
                lose = drop and dropped == 0  # only the first delta frame (a full one is never dropped)
                flat, d, arrived = self._rlhf_delta.receive(channel, bucket, index, drop=lose)
                dropped += int(lose and d.encoding != "full")
                model.load_weights(unpack_bucket(bucket, flat))  # type: ignore[operator]
                nbytes += arrived
            if verify:
                digests.append(digest(flat))
            loaded += len(bucket.slots)
        t_load = time.perf_counter() - t0
        repacked = repack_cpu_linears(model)
        return {
            "tensors": loaded,
            "bytes": nbytes,
            "seconds": time.perf_counter() - t0,
            "load_seconds": t_load,
            "repacked": repacked,
            "digests": digests,
        }


def repack_cpu_linears(model: torch.nn.Module) -> int:
    """On CPU, linears run off a packed copy of the weight: rebuild it after the weight changed."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return 0
    from vllm.model_executor.layers import utils

    count = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if hasattr(module, "cpu_linear") and isinstance(weight, torch.Tensor):
            if weight.numel() == 0:
                raise RuntimeError(
                    "vLLM dropped a CPU linear weight after loading; the rlhf_keep_cpu_weights plugin "
                    "(vllm.general_plugins entry point) is not installed in this environment"
                )
            utils.dispatch_cpu_unquantized_gemm(module, remove_weight=False)
            count += 1
    return count
