"""The chunk dispatcher (rlhf_trainer.rollout.dispatch) with fake engine handles and a fake Ray seam: who
generates which chunk, each finished chunk scored at once, and engine loss mid-stream. No Ray runs here."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from rlhf_trainer.rollout.dispatch import ChunkDispatcher, RaySeam
from rlhf_trainer.rollout.pool import EngineSlot
from rlhf_trainer.transfer import ChunkMeta, plan_chunks

pytestmark = pytest.mark.unit


class Gone(Exception):
    """Stands in for RayActorError: the engine's actor is unreachable."""


class FakeStream:
    """An engine's streaming generator: per chunk a meta ref then a packed ref. The engine may die after
    `die_after` chunks (next raises Gone) or its stream may end there (StopIteration)."""

    def __init__(self, engine: FakeEngine, batch: list[dict[str, Any]]) -> None:
        self.engine = engine
        self.items: list[Any] = []  # refs: ("meta", ChunkMeta) for a chunk's metadata, a str for its tokens
        for job in batch:
            meta = ChunkMeta(job["chunk"], job["shard"], engine.index, len(job["prompts"]), 1, 10, 0.0)
            self.items += [("meta", meta), f"packed:{engine.index}:{job['chunk']}"]
        self.read = 0

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        e = self.engine
        if e.die_after is not None and self.read >= 2 * e.die_after:
            if e.ends_early:
                raise StopIteration
            raise Gone(f"engine {e.index} died")
        if self.read >= len(self.items):
            raise StopIteration
        self.read += 1
        return self.items[self.read - 1]


class FakeEngine:
    """A rollout engine handle: `generate_chunks.options(num_returns="streaming").remote(batch, sampling)`."""

    def __init__(self, index: int, die_after: int | None = None, ends_early: bool = False) -> None:
        self.index = index
        self.die_after = die_after
        self.ends_early = ends_early
        self.scoring_fails = False  # the scorer fails on its chunks while the engine still answers
        self.unreachable_in_wait = False  # ray.wait on its stream raises (the actor's node is gone)
        self.dead = False  # lost after its stream ended: its finished chunks' tokens are gone
        self.batches: list[list[int]] = []
        self.generate_chunks = self
        self.ready = Probe(self)

    def options(self, **_: Any) -> FakeEngine:
        return self

    def remote(self, batch: list[dict[str, Any]], sampling: dict[str, Any]) -> FakeStream:
        self.batches.append([job["chunk"] for job in batch])
        return FakeStream(self, batch)


class Probe:
    """`engine.ready.remote()`: the ref of the engine's answer, an error when it is lost."""

    def __init__(self, engine: FakeEngine) -> None:
        self.engine = engine

    def remote(self) -> tuple[str, Any]:
        return ("ready", self.engine)


class FakeScorer:
    """The reward scorer handle: `score.options(num_returns=2).remote(chunk, packed_ref)`."""

    def __init__(self) -> None:
        self.scored: list[tuple[int, str]] = []
        self.score = self

    def options(self, **_: Any) -> FakeScorer:
        return self

    def remote(self, chunk: int, packed_ref: str) -> tuple[Any, Any]:
        self.scored.append((chunk, packed_ref))
        return ("reward-meta", chunk, packed_ref), ("reward", chunk, packed_ref)


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
        assert kind == "meta", "the dispatcher fetched something other than a chunk's metadata"
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
    rollout = d.run(chunks, prompts, [None] * n_prompts)
    return d, rollout, scorer, lost, logs, chunks


def test_every_chunk_is_generated_once_and_scored_as_it_finishes() -> None:
    engines = [FakeEngine(0), FakeEngine(1)]
    d, rollout, scorer, lost, logs, chunks = dispatch(engines)
    assert len(chunks) == 4
    assert engines[0].batches == [[0, 2]] and engines[1].batches == [[1, 3]]  # plan_chunks' round robin
    assert [m.chunk for m in rollout.metas] == [0, 1, 2, 3]
    assert rollout.packed == ["packed:0:0", "packed:1:1", "packed:0:2", "packed:1:3"]
    assert sorted(scorer.scored) == [(c, rollout.packed[c]) for c in range(4)]
    assert [r[1] for r in rollout.reward_calls] == [("reward", c, rollout.packed[c]) for c in range(4)]
    assert lost == [] and logs == [] and d.streams == {}


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
    assert [r[1] for r in rollout.reward_calls] == [("reward", c, f"packed:1:{c}") for c in range(4)]
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
