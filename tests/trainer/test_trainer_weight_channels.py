"""The CPU weight-sync transports (gloo broadcast, shared memory) between real processes: one trainer
rank sends a bucket plan, two engine ranks receive it, and every tensor arrives bit for bit.

The end-to-end greedy-output check (tests/e2e/ray) covers applying the buckets inside vLLM; this covers
each wire, including reuse of the two alternating shm files across buckets of different sizes and
dtypes, and packing in place into the channel's staging memory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from rlhf_trainer.weight_sync.bucketing import pack_bucket, plan_buckets, unpack_bucket
from rlhf_trainer.weight_sync.channels import Rendezvous, open_channel
from testkit.support import free_port, rank_context, run_ranks

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


def _channel_rank(rank: int, wire: dict[str, Any], shm_dir: str, results: Any) -> None:
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
    results = rank_context().Queue()
    run_ranks(_channel_rank, WORLD, (wire, str(tmp_path), results), timeout=120)
    got = sorted(results.get(timeout=5) for _ in range(WORLD))
    n_buckets = got[0][1]
    assert n_buckets > 4, "the plan should span several buckets of both dtypes"
    assert got == [(0, n_buckets, []), (1, n_buckets, []), (2, n_buckets, [])]
    assert not list(tmp_path.glob("rlhf-weights-*")), "the shm buffer outlived the sync"


def _delta_run(rank: int, wire: dict[str, Any], shm_dir: str, results: Any) -> None:
    """Five syncs of a bf16 plan whose values change by a few, then all, then no elements; engine 2 drops
    the first delta frame of sync 1 (as the `delta_drop` fault does)."""
    import os

    os.environ["RLHF_SHM_DIR"] = shm_dir
    import importlib

    import rlhf_trainer.weight_sync.shm as shm
    from rlhf_trainer.weight_sync.delta import DeltaEncoder, digest
    from rlhf_trainer.weight_sync.delta_wire import DeltaReceiver, DeltaSender

    importlib.reload(shm)
    params = {n: t.to(torch.bfloat16) for n, t in _params().items()}
    plan = plan_buckets(((n, t.shape, t.dtype) for n, t in params.items()), bucket_bytes=16 * 1024)
    channel = open_channel(Rendezvous.from_wire(wire), rank)
    sender, receiver = DeltaSender(DeltaEncoder(full_above=0.5, recheck_every=2)), DeltaReceiver()
    g = torch.Generator().manual_seed(11)
    log: list[tuple[int, list[str], list[int], int]] = []  # (sync, encodings, digests, mismatched)
    for sync in range(5):
        if sync:  # a sparse change (a few elements), a dense one (everything), then none at all, twice
            for t in params.values():
                flat = t.view(-1)
                if sync == 1:
                    pos = torch.randint(0, flat.numel(), (max(1, flat.numel() // 100),), generator=g)
                    flat[pos] = flat[pos] * 1.5 + 0.25
                elif sync == 2:
                    flat.add_(torch.randn(flat.shape, generator=g).to(flat.dtype))
        encodings, digests, wrong = [], [], 0
        for i, bucket in enumerate(plan):
            new = pack_bucket(bucket, [params[n] for n in bucket.names])
            if rank == 0:
                d, _ = sender.send(channel, i, new)
                encodings.append(d.encoding)
                digests.append(digest(sender.held[i]))
            else:
                held, d, _ = receiver.receive(channel, bucket, i, drop=(rank == 2 and sync == 1 and i == 0))
                encodings.append(d.encoding)
                digests.append(digest(held))
                wrong += int(not torch.equal(held.view(torch.int16), new.view(torch.int16)))
        log.append((sync, encodings, digests, wrong))
    channel.close()
    results.put((rank, log))


@pytest.mark.parametrize("backend", ["gloo", "shm"])
def test_delta_frames_keep_every_engine_copy_bit_identical_and_a_dropped_frame_shows_in_the_digest(
    backend: str, tmp_path: Path
) -> None:
    """weightSync.delta over each CPU wire: the first sync goes whole, a sparse change as deltas, a dense
    one whole, no change as empty deltas; after each, every engine's copy equals the new bucket bit for
    bit, except the engine that dropped a frame, whose digest then differs from the trainer's."""
    wire = Rendezvous(backend, "127.0.0.1", free_port(), WORLD, f"d-{backend}").to_wire()
    results = rank_context().Queue()
    run_ranks(_delta_run, WORLD, (wire, str(tmp_path), results), timeout=180)
    logs = dict(results.get(timeout=5) for _ in range(WORLD))
    sender = logs[0]
    # whole at first; the sparse change as deltas (the smaller of gaps and bitmask per bucket); the dense
    # one whole; then whole again without comparing (recheckEvery 2), then compared: empty deltas
    kinds = [set(enc) for _, enc, _, _ in sender]
    assert (
        kinds[0] == {"full"}
        and kinds[1] == {"gaps", "bitmask"}
        and kinds[2:] == [{"full"}, {"full"}, {"gaps"}]
    )
    for rank in (1, 2):
        assert [enc for _, enc, _, _ in logs[rank]] == [enc for _, enc, _, _ in sender]
    # engine 1 holds exactly what the trainer holds after every sync
    assert [w for *_, w in logs[1]] == [0, 0, 0, 0, 0]
    assert [d for _, _, d, _ in logs[1]] == [d for _, _, d, _ in sender]
    # engine 2 dropped bucket 0's delta in sync 1: its copy (and digest) differs there until the dense
    # change of sync 2 arrives whole
    assert [w for *_, w in logs[2]] == [0, 1, 0, 0, 0]
    assert logs[2][1][2][0] != sender[1][2][0] and logs[2][1][2][1:] == sender[1][2][1:]
    assert logs[2][2][2] == sender[2][2]
