"""Packed rollout format and chunk planning (rlhf_trainer.transfer): no padding in transfer."""

from __future__ import annotations

import pickle

import pytest
import torch
from rlhf_trainer.transfer import (
    PackedRollout,
    balance_shards,
    pad_micro_batch,
    pad_response_values,
    plan_chunks,
    split_per_response,
    unpad_response_values,
)

pytestmark = pytest.mark.unit


def sample_tokens(r: PackedRollout, i: int) -> torch.Tensor:
    """Sample i's tokens (prompt + response) out of the packed buffer."""
    off = r.offsets()
    return r.tokens[int(off[i]) : int(off[i + 1])]


def _rollout() -> PackedRollout:
    samples = [
        ([1, 2], [3, 4, 5], [-0.1, -0.2, -0.3]),
        ([6], [7], [-0.4]),
        ([8, 9, 10], [11, 12], [-0.5, -0.6]),
    ]
    return PackedRollout.from_samples(
        samples, [0, 0, 1], ["a", "b", "c"], ["x", "y", "z"], [True, False, True]
    )


def test_packed_has_no_padding_and_round_trips() -> None:
    r = _rollout()
    assert r.tokens.tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    assert r.seq_lens.tolist() == [5, 2, 5] and r.response_lens.tolist() == [3, 1, 2]
    assert sample_tokens(r, 2).tolist() == [8, 9, 10, 11, 12]
    back = pickle.loads(pickle.dumps(r))
    assert torch.equal(back.tokens, r.tokens) and back.responses == ["x", "y", "z"]
    assert r.nbytes() == 8 * (12 + 3 + 3 + 3)


def test_select_and_concat() -> None:
    r = _rollout()
    s = r.select([2, 0])
    assert s.tokens.tolist() == [8, 9, 10, 11, 12, 1, 2, 3, 4, 5]
    assert s.rollout_logprobs.tolist() == pytest.approx([-0.5, -0.6, -0.1, -0.2, -0.3])
    c = PackedRollout.concat([r, s])
    assert c.num_samples == 5 and c.prompts == ["a", "b", "c", "c", "a"]


def test_pad_micro_batch_masks_response_positions() -> None:
    r = _rollout()
    ids, attn, act = pad_micro_batch(r, 0, 2, pad_id=0)
    assert ids.tolist() == [[1, 2, 3, 4, 5], [6, 7, 0, 0, 0]]
    assert attn.tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    # position t predicts token t+1: responses start at prompt_len - 1
    assert act.tolist() == [[0, 1, 1, 1], [1, 0, 0, 0]]
    values = torch.arange(8, dtype=torch.float32).view(2, 4)
    packed = unpad_response_values(values, act)
    assert packed.tolist() == [1.0, 2.0, 3.0, 4.0]
    assert torch.equal(pad_response_values(packed, act), values * act)
    assert [t.tolist() for t in split_per_response(packed, torch.tensor([3, 1]))] == [[1.0, 2.0, 3.0], [4.0]]


def test_micro_batches_cover_all_samples() -> None:
    r = _rollout()
    assert list(r.micro_batches(2)) == [(0, 2), (2, 3)]
    with pytest.raises(ValueError):
        list(r.micro_batches(0))


def test_mini_batches_split_the_samples_into_optimizer_steps_of_micro_batches() -> None:
    r = PackedRollout.concat([_rollout(), _rollout()])  # 6 samples
    assert r.mini_batches(1, 4) == [[(0, 4), (4, 6)]]
    assert r.mini_batches(2, 2) == [[(0, 2), (2, 3)], [(3, 5), (5, 6)]]
    assert r.mini_batches(3, 1) == [[(0, 1), (1, 2)], [(2, 3), (3, 4)], [(4, 5), (5, 6)]]
    with pytest.raises(ValueError):
        r.mini_batches(0, 1)


def test_digest_follows_the_tokens() -> None:
    a, b = _rollout(), _rollout()
    assert a.digest() == b.digest()
    b.tokens[0] += 1
    assert a.digest() != b.digest()


def test_plan_chunks_whole_prompts_balanced_shards() -> None:
    chunks = plan_chunks(16, shards=2, engines=3)
    per_shard: dict[int, list[int]] = {}
    for shard, engine, idx in chunks:
        assert 0 <= engine < 3
        per_shard.setdefault(shard, []).extend(idx)
    assert sorted(per_shard[0]) == list(range(8)) and sorted(per_shard[1]) == list(range(8, 16))
    assert len(chunks) >= 4  # at least two chunks per shard: reward overlaps generation
    assert {e for _, e, _ in chunks} == {0, 1, 2}
    with pytest.raises(ValueError):
        plan_chunks(15, shards=2, engines=1)


def test_generated_chunks_go_to_ranks_by_tokens_and_each_rank_keeps_its_sample_count() -> None:
    """Issue 39 item 2: micro-batches balanced by tokens across ranks. Planned round robin, rank 0 would
    get the two long chunks (190 tokens against 30); balanced, 110 each, two 2-prompt chunks each."""
    chunks = plan_chunks(8, shards=2, engines=1)  # 2 prompts a chunk: shards 0, 1, 0, 1
    assert [s for s, _, _ in chunks] == [0, 1, 0, 1]
    owners = balance_shards([s for s, _, _ in chunks], [len(i) for _, _, i in chunks], [100, 10, 90, 20])
    assert owners == [0, 0, 1, 1]
    load = {s: sum(t for o, t in zip(owners, [100, 10, 90, 20], strict=True) if o == s) for s in (0, 1)}
    assert load == {0: 110, 1: 110}


def test_balancing_keeps_each_ranks_chunk_sizes_and_the_plan_when_tokens_are_even() -> None:
    # a 3-prompt chunk can only trade places with another 3-prompt chunk
    shards, sizes = [0, 1, 0, 1], [3, 3, 2, 2]
    owners = balance_shards(shards, sizes, [300, 10, 200, 5])
    for s in (0, 1):
        assert sorted(z for o, z in zip(owners, sizes, strict=True) if o == s) == [2, 3]
    assert owners == [0, 1, 1, 0]  # planned 300 + 200 against 10 + 5; now 300 + 5 against 10 + 200
    assert balance_shards(shards, sizes, [50, 50, 50, 50]) == shards  # ties: as planned
