"""Weight-sync bucket plan (rlhf_trainer.weight_sync.bucketing): bounded, same-dtype, lossless."""

from __future__ import annotations

import json

import pytest
import torch
from rlhf_trainer.weight_sync.bucketing import (
    pack_bucket,
    plan_buckets,
    plan_bytes,
    plan_from_wire,
    plan_to_wire,
    unpack_bucket,
)

pytestmark = pytest.mark.unit


def _params() -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    return [
        ("embed", (64, 32), torch.float32),  # 8 KiB
        ("norm", (32,), torch.float32),
        ("q", (32, 32), torch.float32),  # 4 KiB
        ("half", (16, 16), torch.bfloat16),
        ("big", (128, 64), torch.float32),  # 32 KiB: larger than a bucket
        ("lm_head", (64, 32), torch.float32),
    ]


def test_buckets_are_bounded_and_cover_every_param_once() -> None:
    plan = plan_buckets(_params(), bucket_bytes=12 * 1024)
    names = [n for b in plan for n in b.names]
    assert sorted(names) == sorted(n for n, _, _ in _params())
    for b in plan:
        assert len({b.dtype}) == 1
        assert b.nbytes <= 12 * 1024 or len(b.slots) == 1  # only an oversize tensor exceeds the bound
    assert any(b.names == ["big"] for b in plan)
    assert plan_bytes(plan) == sum(torch.empty(s, dtype=d).nbytes for _, s, d in _params())


def test_dtypes_never_mix() -> None:
    plan = plan_buckets(_params(), bucket_bytes=1 << 20)
    assert {b.dtype for b in plan} == {"float32", "bfloat16"}
    assert len(plan) == 2


def test_pack_unpack_round_trip_and_wire() -> None:
    torch.manual_seed(0)
    params = _params()
    tensors = {n: torch.randn(s).to(d) for n, s, d in params}
    plan = plan_from_wire(json.loads(json.dumps(plan_to_wire(plan_buckets(params, 12 * 1024)))))
    for b in plan:
        flat = pack_bucket(b, [tensors[n] for n in b.names])
        assert flat.numel() == b.numel
        for name, view in unpack_bucket(b, flat):
            assert torch.equal(view, tensors[name])


def test_shape_mismatch_is_an_error() -> None:
    plan = plan_buckets([("a", (2, 2), torch.float32)], 1024)
    with pytest.raises(ValueError, match="a: shape"):
        pack_bucket(plan[0], [torch.zeros(4)])
    with pytest.raises(ValueError):
        plan_buckets([], 0)
