"""Packed rollout format and chunk planning (rlhf_trainer.transfer): no padding in transfer."""

from __future__ import annotations

import pickle

import pytest
import torch
from rlhf_trainer.transfer import (
    PackedRollout,
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
