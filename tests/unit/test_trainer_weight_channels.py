"""The CPU weight-sync transports (gloo broadcast, shared memory) between real processes: one trainer
rank sends a bucket plan, two engine ranks receive it, and every tensor arrives bit for bit.

The end-to-end greedy-output check (tests/trainer) covers applying the buckets inside vLLM; this covers
each wire, including reuse of the two alternating shm files across buckets of different sizes and
dtypes, and packing in place into the channel's staging memory.
"""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path
from typing import Any

import pytest
import torch
from rlhf_trainer.weight_sync.bucketing import pack_bucket, plan_buckets, unpack_bucket
from rlhf_trainer.weight_sync.channels import Rendezvous, open_channel
from support import free_port, run_ranks

pytestmark = pytest.mark.unit
WORLD = 3  # the trainer's rank 0 and two engines


def _params() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    shapes = [(64, 32), (32,), (96, 32), (7, 3), (128, 64), (5,)]
    out = {}
    for i, shape in enumerate(shapes * 4):  # 24 tensors, several buckets per dtype
        dtype = torch.bfloat16 if i % 3 == 2 else torch.float32
        out[f"layer{i}.w"] = torch.randn(shape, generator=g).to(dtype)
    return out


def _run(rank: int, wire: dict[str, Any], shm_dir: str, results: Any) -> None:
    import os

    os.environ["RLHF_SHM_DIR"] = shm_dir
    import importlib

    import rlhf_trainer.weight_sync.shm as shm

    importlib.reload(shm)  # SHM_DIR is read at import
    params = _params()
    plan = plan_buckets(((n, t.shape, t.dtype) for n, t in params.items()), bucket_bytes=16 * 1024)
    channel = open_channel(Rendezvous.from_wire(wire), rank)
    mismatched = []
    for i, bucket in enumerate(plan):
        if rank == 0:  # odd buckets are packed in place into the channel's staging memory, even ones not
            out = channel.staging(bucket, i) if i % 2 else None
            channel.send(pack_bucket(bucket, [params[n] for n in bucket.names], out=out), i)
        else:
            flat = channel.recv(bucket, i)
            for name, view in unpack_bucket(bucket, flat):
                if not torch.equal(view, params[name]):
                    mismatched.append(name)
            channel.done_with(i)
    channel.close()
    results.put((rank, len(plan), mismatched))


@pytest.mark.parametrize("backend", ["gloo", "shm"])
def test_every_engine_receives_every_tensor_bit_for_bit(backend: str, tmp_path: Path) -> None:
    wire = Rendezvous(backend, "127.0.0.1", free_port(), WORLD, f"t-{backend}").to_wire()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    run_ranks(_run, WORLD, (wire, str(tmp_path), results), timeout=120)
    got = sorted(results.get(timeout=5) for _ in range(WORLD))
    n_buckets = got[0][1]
    assert n_buckets > 4, "the plan should span several buckets of both dtypes"
    assert got == [(0, n_buckets, []), (1, n_buckets, []), (2, n_buckets, [])]
    assert not list(tmp_path.glob("rlhf-weights-*")), "the shm buffer outlived the sync"
