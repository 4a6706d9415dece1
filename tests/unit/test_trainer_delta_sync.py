"""Delta weight sync's encoding (weight_sync/delta.py): the receiver's copy after a delta is the sender's
bucket bit for bit, whichever encoding the changed fraction picks, and a delta never costs more bytes
than the whole bucket; a missed delta shows in the digest. benchmarks/delta_sync.py measures it."""

from __future__ import annotations

import pytest
import torch
from rlhf_trainer.weight_sync import delta

pytestmark = pytest.mark.unit


def _bucket(n: int, seed: int) -> torch.Tensor:
    return (torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 0.02).to(torch.bfloat16)


def _bits(t: torch.Tensor) -> list[int]:
    return t.view(torch.int16).tolist()


@pytest.mark.parametrize(("fraction", "encoding"), [(0.0, "gaps"), (0.01, "gaps"), (0.1, "bitmask"),
                                                     (0.9, "full")])  # fmt: skip
def test_the_receiver_ends_bit_identical_whatever_the_encoding(fraction: float, encoding: str) -> None:
    n = 10_003  # not a multiple of 8: the bitmask's last byte is partial
    old = _bucket(n, 0)
    new = old.clone()
    idx = torch.randperm(n, generator=torch.Generator().manual_seed(1))[: int(n * fraction)]
    new[idx] = (new[idx].float() + 1e-3).to(torch.bfloat16)  # at least one bf16 step: a real change
    d = delta.encode(new, old)
    assert d.encoding == encoding
    held = old.clone()
    delta.apply(d, held)
    assert _bits(held) == _bits(new)
    assert d.nbytes <= n * 2  # never more than the whole bucket
    assert d.changed == len(idx)
    if encoding == "gaps":
        assert d.nbytes == len(idx) * (2 + 2)  # a uint16 gap and a bf16 value per change
    if encoding == "bitmask":
        assert d.nbytes == (n + 7) // 8 + len(idx) * 2


def test_long_unchanged_runs_get_fillers_and_still_land_exactly() -> None:
    n = 300_000  # over four MAX_GAPs
    old = _bucket(n, 5)
    new = old.clone()
    for i in (3, 250_000):
        new[i] = (new[i].float() + 0.01).to(torch.bfloat16)
    d = delta.encode(new, old)
    assert d.encoding == "gaps" and d.changed == 2
    assert d.gaps is not None and int(d.gaps.to(torch.int32).max()) <= delta.MAX_GAP
    assert d.values.numel() == 2 + n // delta.MAX_GAP + 1  # the changes, plus a filler every MAX_GAP
    held = old.clone()
    delta.apply(d, held)
    assert _bits(held) == _bits(new)


def test_changes_are_bitwise_signed_zeros_and_nans_included() -> None:
    old = torch.tensor([0.0, 1.0, float("nan"), 2.0], dtype=torch.bfloat16)
    new = torch.tensor([-0.0, 1.0, float("nan"), 2.0], dtype=torch.bfloat16)
    assert delta.changed_mask(new, old).tolist() == [True, False, False, False]
    held = old.clone()
    delta.apply(delta.encode(new, old), held)
    assert _bits(held) == _bits(new)


def test_bits_pack_and_unpack() -> None:
    mask = torch.rand(77, generator=torch.Generator().manual_seed(2)) > 0.6
    packed = delta.pack_bits(mask)
    assert packed.numel() == 10 and packed.dtype == torch.uint8
    assert delta.unpack_bits(packed, 77).tolist() == mask.tolist()


def test_a_first_sync_or_a_layout_change() -> None:
    new = _bucket(64, 3)
    assert delta.encode(new, None).encoding == "full"
    with pytest.raises(ValueError, match="layout"):
        delta.encode(new, _bucket(65, 3))
    with pytest.raises(ValueError, match="applied to a bucket"):
        delta.apply(delta.encode(new, new.clone()), _bucket(65, 3))


def test_a_missed_delta_shows_in_the_digest() -> None:
    old = _bucket(4096, 4)
    step1 = old.clone()
    step1[7] = (step1[7].float() + 0.01).to(torch.bfloat16)
    step2 = step1.clone()
    step2[9] = (step2[9].float() + 0.01).to(torch.bfloat16)
    held = old.clone()
    delta.apply(delta.encode(step2, step1), held)  # the receiver never got step 1's delta
    assert delta.digest(held) != delta.digest(step2)
    delta.apply(delta.encode(step2, None), held)  # a full sync repairs it
    assert delta.digest(held) == delta.digest(step2)
    swapped = step2.clone()
    swapped[[7, 9]] = swapped[[9, 7]]  # same values, other places: the digest is order-sensitive
    assert delta.digest(swapped) != delta.digest(step2)


def test_the_encoder_skips_comparing_a_bucket_that_went_whole_until_its_recheck() -> None:
    enc = delta.DeltaEncoder(recheck_every=3)
    old = _bucket(1000, 6)
    new = (old.float() + 0.01).to(torch.bfloat16)  # everything changed: whole
    first = enc.encode(0, new, old)
    assert (first.encoding, first.changed) == ("full", 1000)  # compared: too much changed
    for _ in range(2):  # the next recheck_every - 1 syncs send it whole without comparing
        skipped = enc.encode(0, new, old)
        assert (skipped.encoding, skipped.changed) == ("full", -1)
    d = enc.encode(0, new.clone(), new)  # the recheck compares again: nothing changed now
    assert (d.encoding, d.changed) == ("gaps", 0)
    assert enc.encode(1, new, None).encoding == "full"  # another bucket, first sync
