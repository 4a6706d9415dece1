"""The chunk dispatcher (rlhf_trainer.rollout.dispatch) with fake engine handles and a fake Ray seam: who
generates which chunk, each finished request scored at once and each chunk's reward assembled from its own
requests, and engine loss mid-stream. No Ray runs here."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from rlhf_trainer.rollout.dispatch import ChunkDispatcher, RaySeam, in_request_order
from rlhf_trainer.rollout.pool import EngineSlot
from rlhf_trainer.transfer import ChunkMeta, FinishedRequest, plan_chunks

pytestmark = pytest.mark.unit


class Gone(Exception):
    """Stands in for RayActorError: the engine's actor is unreachable."""


class FakeStream:
    """An engine's streaming generator: per chunk a request ref per prompt (last first: requests finish out
    of order), then a meta ref and a packed ref. The engine may die after `die_after` chunks and
    `die_within` requests of the next (next raises Gone), or its stream may end there (StopIteration)."""

    def __init__(self, engine: FakeEngine, batch: list[dict[str, Any]]) -> None:
        self.engine = engine
        # refs: ("item", FinishedRequest | ChunkMeta) for what the driver reads, a str for a chunk's tokens
        self.items: list[Any] = []
        self.dies_at: int | None = None  # items read before the engine dies
        for k, job in enumerate(batch):
            if k == engine.die_after:
                self.dies_at = len(self.items) + engine.die_within
            c, n = job["chunk"], len(job["prompts"])
            for i in reversed(range(n)):
                self.items.append(
                    ("item", FinishedRequest(c, i, job["prompts"][i], [f"r{engine.index}"] * 2))
                )
            meta = ChunkMeta(c, job["shard"], engine.index, 2 * n, 1, 10, 0.0)
            self.items += [("item", meta), f"packed:{engine.index}:{c}"]
        if engine.die_after is not None and self.dies_at is None:
            self.dies_at = len(self.items)
        self.read = 0

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        e = self.engine
        if self.dies_at is not None and self.read >= self.dies_at:
            if e.ends_early:
                raise StopIteration
            raise Gone(f"engine {e.index} died")
        if self.read >= len(self.items):
            raise StopIteration
        self.read += 1
        return self.items[self.read - 1]


class FakeEngine:
    """A rollout engine handle: `generate_chunks.options(num_returns="streaming").remote(batch, sampling)`."""

    def __init__(
        self, index: int, die_after: int | None = None, ends_early: bool = False, die_within: int = 0
    ) -> None:
        self.index = index
        self.die_after = die_after
        self.die_within = die_within
        self.ends_early = ends_early
        self.scoring_fails = False  # the scorer fails on its chunks while the engine still answers
        self.unreachable_in_wait = False  # ray.wait on its stream raises (the actor's node is gone)
        self.dead = False  # lost after its stream ended: its finished chunks' tokens are gone
        self.batches: list[list[int]] = []
        self.jobs: list[dict[str, Any]] = []  # every chunk job it was sent, as sent
        self.generate_chunks = self
        self.ready = Probe(self)

    def options(self, **_: Any) -> FakeEngine:
        return self

    def remote(self, batch: list[dict[str, Any]], sampling: dict[str, Any]) -> FakeStream:
        self.batches.append([job["chunk"] for job in batch])
        self.jobs += batch
        return FakeStream(self, batch)


class Probe:
    """`engine.ready.remote()`: the ref of the engine's answer, an error when it is lost."""

    def __init__(self, engine: FakeEngine) -> None:
        self.engine = engine

    def remote(self) -> tuple[str, Any]:
        return ("ready", self.engine)


class FakeScorer:
    """The reward scorer handle: `score_request.remote(request_ref)` for each finished request, then
    `assemble.options(num_returns=2).remote(chunk, packed_ref, *request_score_refs)` for each chunk."""

    def __init__(self) -> None:
        self.requests: list[tuple[int, int, str]] = []  # (chunk, request, response) as scored, in order
        self.scored: list[tuple[int, str]] = []  # (chunk, packed ref) as assembled
        self.columns: dict[tuple[int, int], dict[str, Any]] = {}  # (chunk, request) -> its row's columns
        self.score_request = Method(self._score_request)
        self.assemble = Method(self._assemble)

    def _score_request(self, ref: tuple[str, FinishedRequest], columns: dict[str, Any]) -> tuple[Any, ...]:
        req = ref[1]
        self.requests.append((req.chunk, req.request, req.responses[0]))
        self.columns[(req.chunk, req.request)] = columns
        return ("request-scores", req.chunk, req.request, req.responses[0])

    def _assemble(self, chunk: int, packed_ref: str, *requests: tuple[Any, ...]) -> tuple[Any, Any]:
        self.scored.append((chunk, packed_ref))
        return ("reward-meta", chunk, packed_ref), ("reward", chunk, packed_ref, requests)


class Method:
    """An actor method handle: `.remote(...)`, and `.options(...)` that changes nothing here."""

    def __init__(self, fn: Any) -> None:
        self.remote = fn

    def options(self, **_: Any) -> Method:
        return self


def fake_seam() -> RaySeam:
    def wait(streams: list[FakeStream], num_returns: int = 1, timeout: float | None = None) -> Any:
        for s in streams:
            if s.engine.unreachable_in_wait:
                raise Gone(f"engine {s.engine.index} unreachable")
        return streams[:num_returns], streams[num_returns:]

    def get(ref: tuple[Any, ...], timeout: float | None = None) -> Any:
        kind, value = ref[0], ref[1]
        if kind == "ready":  # the liveness probe
            if value.dead:
                raise Gone(f"engine {value.index} unreachable")
            return {"ready": True}
        if kind == "reward-meta":  # the scorer read the chunk's tokens from its engine's node
            engine = ENGINES[int(ref[2].split(":")[1])]
            if engine.dead or engine.scoring_fails:
                raise Gone(f"chunk {value}: an argument could not be computed")
            return {"chunk": value, "packed": ref[2]}
        assert kind == "item", "the dispatcher fetched something other than metadata or a request's texts"
        return value

    return RaySeam(wait=wait, get=get, gone=(Gone,))


ENGINES: dict[int, FakeEngine] = {}  # the fakes of the running test, by index, for the fake ray.get


def dispatch(engines: list[FakeEngine], n_prompts: int = 8, shards: int = 2) -> tuple[Any, ...]:
    ENGINES.clear()
    ENGINES.update({e.index: e for e in engines})
    slots = [EngineSlot(index=e.index, handle=e, state="ready") for e in engines]
    scorer = FakeScorer()
    lost: list[int] = []
    logs: list[str] = []
    d = ChunkDispatcher(
        step=3,
        engines=slots,
        reward=scorer,
        sampling={"n": 2},
        on_lost=lambda slot, err: lost.append(slot.index),
        log=logs.append,
        ray_seam=fake_seam(),
    )
    chunks = plan_chunks(n_prompts, shards, len(engines))
    prompts = [f"p{i}" for i in range(n_prompts)]
    columns = [{"row": i} for i in range(n_prompts)]
    rollout = d.run(chunks, prompts, [None] * n_prompts, columns)
    return d, rollout, scorer, lost, logs, chunks


def scores_of(chunk: int, engine: int, requests: int = 2) -> tuple[tuple[Any, ...], ...]:
    """The fake scorer's refs of a chunk's request scores, in request order, from `engine`'s samples."""
    return tuple(("request-scores", chunk, i, f"r{engine}") for i in range(requests))


def test_each_request_goes_to_the_scorer_with_its_rows_columns_which_never_reach_the_engines() -> None:
    engines = [FakeEngine(0), FakeEngine(1)]
    _, _, scorer, _, _, chunks = dispatch(engines)
    assert scorer.columns == {
        (c, r): {"row": idx[r]} for c, (_, _, idx) in enumerate(chunks) for r in range(len(idx))
    }
    assert all("columns" not in job for e in engines for job in e.jobs)


def test_every_request_is_scored_as_it_finishes_and_each_chunk_assembled_in_request_order() -> None:
    engines = [FakeEngine(0), FakeEngine(1)]
    d, rollout, scorer, lost, logs, chunks = dispatch(engines)
    assert len(chunks) == 4
    assert engines[0].batches == [[0, 2]] and engines[1].batches == [[1, 3]]  # plan_chunks' round robin
    assert [m.chunk for m in rollout.metas] == [0, 1, 2, 3]
    assert rollout.packed == ["packed:0:0", "packed:1:1", "packed:0:2", "packed:1:3"]
    # every request went to the scorer as it streamed (request 1 finished before request 0)
    assert sorted(scorer.requests) == [(c, i, f"r{c % 2}") for c in range(4) for i in range(2)]
    assert scorer.requests[:2] == [(0, 1, "r0"), (0, 0, "r0")]
    assert sorted(scorer.scored) == [(c, rollout.packed[c]) for c in range(4)]
    assert [r[1] for r in rollout.reward_calls] == [
        ("reward", c, rollout.packed[c], scores_of(c, c % 2)) for c in range(4)
    ]
    assert lost == [] and logs == [] and d.streams == {} and d.request_scores == {}


def test_an_engine_lost_mid_stream_has_all_its_chunks_generated_again_on_the_others() -> None:
    """Engine 0 finishes chunk 0, then dies: chunk 0 (finished, but its tokens were on the lost node) and
    chunk 2 go to engine 1; the step's rollout and rewards come from engine 1's copies."""
    engines = [FakeEngine(0, die_after=1), FakeEngine(1)]
    d, rollout, scorer, lost, logs, _ = dispatch(engines)
    assert lost == [0] and d.lost == {0}
    assert engines[1].batches == [[1, 3], [0, 2]]
    assert [m.engine for m in rollout.metas] == [1, 1, 1, 1]
    assert rollout.packed == ["packed:1:0", "packed:1:1", "packed:1:2", "packed:1:3"]
    assert (0, "packed:0:0") in scorer.scored  # scored once generated, then superseded
    assert [r[1] for r in rollout.reward_calls] == [
        ("reward", c, f"packed:1:{c}", scores_of(c, 1)) for c in range(4)
    ]
    assert d.assigned == {1: d.assigned[1]} and sorted(j["chunk"] for j in d.assigned[1]) == [0, 1, 2, 3]
    assert logs == ["step 3: rollout engine 0 lost (Gone); 2 chunk(s) generated again on engine(s) [1]"]


def test_a_stream_that_ends_early_counts_as_its_engine_lost() -> None:
    engines = [FakeEngine(0, die_after=1, ends_early=True), FakeEngine(1)]
    _, rollout, _, lost, logs, _ = dispatch(engines)
    assert lost == [0]
    assert engines[1].batches == [[1, 3], [0, 2]]
    assert [m.engine for m in rollout.metas] == [1, 1, 1, 1]
    assert logs == [
        "step 3: rollout engine 0 lost (RuntimeError); 2 chunk(s) generated again on engine(s) [1]"
    ]


def test_when_ray_wait_raises_the_unreachable_engine_is_found_and_its_chunks_move() -> None:
    engines = [FakeEngine(0), FakeEngine(1), FakeEngine(2)]
    engines[1].unreachable_in_wait = True
    _, rollout, _, lost, logs, chunks = dispatch(engines, n_prompts=12, shards=2)
    assert lost == [1]
    moved = [c for c, (_, e, _) in enumerate(chunks) if e == 1]
    assert moved and all(rollout.metas[c].engine in (0, 2) for c in moved)
    assert [m.chunk for m in rollout.metas] == list(range(len(chunks)))
    assert "rollout engine 1 lost (Gone)" in logs[0]


def test_with_no_engine_left_the_step_fails() -> None:
    engines = [FakeEngine(0, die_after=0), FakeEngine(1, die_after=1)]
    with pytest.raises(RuntimeError, match=r"step 3: every rollout engine was lost \(last: Gone"):
        dispatch(engines)


def test_scored_gives_every_chunks_reward_meta_in_chunk_order() -> None:
    engines = [FakeEngine(0), FakeEngine(1)]
    d, rollout, _, lost, _, _ = dispatch(engines)
    again, metas = d.scored()
    assert [m["chunk"] for m in metas] == [0, 1, 2, 3] and again.packed == rollout.packed and lost == []


def test_an_engine_lost_after_its_stream_ended_has_its_chunks_generated_again_when_scoring_finds_them_gone() -> (
    None
):
    """Engine 0 finished chunks 0 and 2, then its node went: the streams never said so, the scorer cannot
    read those chunks. They are generated again on engine 1 and scored again; the step goes on."""
    engines = [FakeEngine(0), FakeEngine(1)]
    d, _, scorer, lost, logs, _ = dispatch(engines)
    engines[0].dead = True
    rollout, metas = d.scored()
    assert lost == [0]
    assert engines[1].batches == [[1, 3], [0, 2]]
    assert rollout.packed == ["packed:1:0", "packed:1:1", "packed:1:2", "packed:1:3"]
    assert [m["packed"] for m in metas] == rollout.packed
    assert [m.engine for m in rollout.metas] == [1, 1, 1, 1]
    assert (0, "packed:1:0") in scorer.scored and (2, "packed:1:2") in scorer.scored
    assert logs == ["step 3: rollout engine 0 lost (Gone); 2 chunk(s) generated again on engine(s) [1]"]


def test_a_scoring_failure_while_the_engine_answers_is_raised_not_taken_for_a_loss() -> None:
    engines = [FakeEngine(0), FakeEngine(1)]
    d, _, _, lost, _, _ = dispatch(engines)
    engines[1].scoring_fails = True
    with pytest.raises(Gone, match="chunk 1"):
        d.scored()
    assert lost == [] and engines[0].batches == [[0, 2]]


def test_scoring_that_finds_every_engine_gone_fails_the_step() -> None:
    engines = [FakeEngine(0), FakeEngine(1)]
    d, *_ = dispatch(engines)
    engines[0].dead = engines[1].dead = True
    with pytest.raises(RuntimeError, match="every rollout engine was lost"):
        d.scored()


def test_a_chunk_lost_between_its_requests_is_assembled_only_from_its_regenerated_requests() -> None:
    """Engine 0 finishes chunk 0 and one request of chunk 2 (request 1 streams first), then dies. That
    request's scores are dropped with the loss; chunks 0 and 2 are assembled from engine 1's requests."""
    engines = [FakeEngine(0, die_after=1, die_within=1), FakeEngine(1)]
    ENGINES.clear()
    ENGINES.update({e.index: e for e in engines})
    scorer = FakeScorer()
    pending_at_loss: list[dict[int, list[int]]] = []
    d = ChunkDispatcher(
        step=3,
        engines=[EngineSlot(index=e.index, handle=e, state="ready") for e in engines],
        reward=scorer,
        sampling={"n": 2},
        on_lost=lambda slot, err: None,
        log=lambda line: pending_at_loss.append({c: sorted(r) for c, r in d.request_scores.items()}),
        ray_seam=fake_seam(),
    )
    rollout = d.run(plan_chunks(8, 2, 2), [f"p{i}" for i in range(8)], [None] * 8)
    assert (2, 1, "r0") in scorer.requests  # scored as it streamed, before the engine died
    assert 2 not in pending_at_loss[0]  # ...and dropped with the loss, not left for the new generation
    assert [r[1] for r in rollout.reward_calls] == [
        ("reward", c, f"packed:1:{c}", scores_of(c, 1)) for c in range(4)
    ]
    assert d.request_scores == {}


def test_in_request_order_gives_a_chunks_request_scores_in_sample_order_or_raises() -> None:
    assert in_request_order(5, {2: "c", 0: "a", 1: "b"}, 3) == ["a", "b", "c"]
    with pytest.raises(RuntimeError, match=r"chunk 5 finished with requests \[0, 2\], not 0..2"):
        in_request_order(5, {0: "a", 2: "c"}, 3)
    with pytest.raises(RuntimeError, match="chunk 5"):
        in_request_order(5, {0: "a", 1: "b", 3: "d"}, 2)
