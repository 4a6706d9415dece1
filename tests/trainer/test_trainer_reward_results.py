"""A chunk's reward from its requests' scores (rlhf_trainer.workers.reward_results): sub-batch splits,
score checks, and assembly in sample order that refuses scores it cannot pair with their samples."""

from __future__ import annotations

import math

import pytest
from rlhf_trainer.workers.reward_results import RequestScores, assemble_chunk, checked_scores, sub_batches

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "n, parts, sizes",
    [(8, 16, [1] * 8), (8, 4, [2, 2, 2, 2]), (10, 4, [2, 3, 2, 3]), (3, 1, [3]), (0, 4, [0])],
)
def test_sub_batches_cover_every_sample_once_in_order(n: int, parts: int, sizes: list[int]) -> None:
    got = sub_batches(n, parts)
    assert [len(r) for r in got] == sizes
    assert [i for r in got for i in r] == list(range(n))


def test_sub_batches_need_one_part() -> None:
    with pytest.raises(ValueError, match="at least one sub-batch"):
        sub_batches(4, 0)


def test_checked_scores_fail_only_the_bad_sample_unless_the_count_is_wrong() -> None:
    assert checked_scores([1, "2.5", None, math.inf], 4) == (
        [1.0, 2.5, None, None],
        "reward returned a non-number: None",
    )
    assert checked_scores([1.0, 2.0], 3) == ([None] * 3, "reward returned 2 scores for 3 samples")


def scores(chunk: int, request: int, values: list[float | None], msg: str = "") -> RequestScores:
    return RequestScores(chunk, request, values, [msg] if msg else [], seconds=0.5)


def test_a_chunk_is_assembled_in_request_order_whatever_order_its_requests_finished() -> None:
    finished = [scores(4, 2, [5.0, 6.0]), scores(4, 0, [1.0, None], "boom"), scores(4, 1, [3.0, 4.0])]
    meta, result = assemble_chunk(4, finished, samples=6)
    assert result.scores.tolist() == [1.0, 0.0, 3.0, 4.0, 5.0, 6.0]
    assert result.valid.tolist() == [True, False, True, True, True, True]
    assert (meta.chunk, meta.samples, meta.errors, meta.score_sum) == (4, 6, 1, 19.0)
    assert meta.seconds == 1.5 and meta.messages == ["boom"]


def test_messages_are_capped_per_chunk() -> None:
    finished = [scores(0, i, [None], f"e{i}") for i in range(5)]
    assert assemble_chunk(0, finished, 5)[0].messages == ["e0", "e1", "e2"]


@pytest.mark.parametrize(
    "finished, samples, needle",
    [
        ([scores(1, 0, [1.0]), scores(1, 2, [1.0])], 2, "not requests 0..1"),  # request 1 missing
        ([scores(1, 0, [1.0]), scores(1, 0, [1.0])], 2, "not requests 0..1"),  # request 0 twice
        ([scores(1, 0, [1.0]), scores(2, 1, [1.0])], 2, r"\(2, 1\)"),  # another chunk's request
        ([scores(1, 0, [1.0, 2.0])], 3, "2 scores for its 3 samples"),  # the chunk has more samples
    ],
)
def test_scores_that_cannot_be_paired_with_the_chunks_samples_are_refused(
    finished: list[RequestScores], samples: int, needle: str
) -> None:
    with pytest.raises(ValueError, match=needle):
        assemble_chunk(1, finished, samples)
