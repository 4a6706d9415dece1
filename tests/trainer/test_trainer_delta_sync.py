"""Delta weight sync's encoding (weight_sync/delta.py): the receiver's copy after a delta is the sender's
bucket bit for bit, whichever encoding the changed fraction picks, and a delta never costs more bytes
than the whole bucket; a missed delta shows in the digest. benchmarks/delta_sync.py measures it."""

from __future__ import annotations

import time
from typing import Any

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


def test_choose_time_sends_whole_where_the_delta_would_cost_more_time_and_prices_again_ever_later() -> None:
    """weightSync.delta.choose time: a 1 % change is a delta over a slow link and goes whole over one as
    fast as memory (comparing and applying it would take longer); a bucket priced whole is not priced
    again for recheck_every syncs, then twice as many."""
    old = _bucket(1 << 16, 7)
    new = old.clone()
    new[::100] = (new[::100].float() + 1.0).to(torch.bfloat16)
    slow = delta.DeltaEncoder(recheck_every=2, choose="time", seconds_per_byte=1e-3)  # 1 KB/s
    assert slow.encode(0, new, old).encoding != "full"
    fast = delta.DeltaEncoder(recheck_every=2, choose="time", seconds_per_byte=1e-15)  # 1 PB/s
    sent = [fast.encode(0, new, old) for _ in range(8)]
    # priced whole, 1 skipped; priced whole, 3 skipped; priced whole (7 to skip), 1 of them skipped
    assert [d.encoding for d in sent] == ["full"] * 8 and all(d.changed == -1 for d in sent)
    assert fast.skip[0] == 6 and fast.window[0] == 16
    by_bytes = delta.DeltaEncoder(recheck_every=2, choose="bytes", seconds_per_byte=1e-15)
    assert by_bytes.encode(0, new, old).encoding != "full"  # bytes decide, whatever the link
    unknown = delta.DeltaEncoder(recheck_every=2, choose="time")  # no whole bucket sent yet
    assert unknown.encode(0, new, old).encoding != "full"


def test_the_link_speed_comes_from_whole_buckets_sent() -> None:
    enc = delta.DeltaEncoder(choose="time")
    enc.observe_link(1000, 0.002)
    assert enc.seconds_per_byte == pytest.approx(2e-6)
    enc.observe_link(1000, 0.004)  # smoothed: half the last, half the new
    assert enc.seconds_per_byte == pytest.approx(3e-6)
    enc.observe_link(0, 1.0)  # nothing sent: nothing learnt
    assert enc.seconds_per_byte == pytest.approx(3e-6)


def test_the_sender_measures_the_link_on_whole_buckets_and_forgets_it_on_a_new_channel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from rlhf_trainer.weight_sync import delta_wire

    def slow_link(channel: Any, d: delta.Delta, index: int) -> int:
        time.sleep(0.05)
        return d.nbytes

    monkeypatch.setattr(delta_wire, "send_frame", slow_link)
    sender = delta_wire.DeltaSender(delta.DeltaEncoder(choose="time"))
    old = _bucket(4096, 3)
    sender.send(None, 0, old)  # the first sync of a channel: whole
    link = sender.encoder.seconds_per_byte
    assert link is not None and link >= 0.05 / old.nbytes
    new = old.clone()
    new[0] = (new[0].float() + 1.0).to(torch.bfloat16)
    d, _ = sender.send(None, 0, new)  # 1 change over a 50 ms link: a delta, which says nothing of the link
    assert d.encoding != "full" and sender.encoder.seconds_per_byte == link
    sender.reset()
    assert sender.encoder.seconds_per_byte is None
