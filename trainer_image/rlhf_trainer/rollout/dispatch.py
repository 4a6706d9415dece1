"""One step's generation: chunks streamed out of the engines, each finished request scored at once.

Owns which engine generates which chunk, reading the engines' streams, handing each finished request to
the reward scorer and each finished chunk's requests to its assembly, and engine loss (a lost engine's
chunks are generated again on the others, their requests' scores discarded), both mid-generation and
after an engine finished its chunks, when the scorer finds their tokens gone.
Must not fetch tokens: only chunk metadata and request texts are read here; packed rollouts stay in the
object store.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import ray
from ray.exceptions import GetTimeoutError, ObjectLostError, RayActorError

from rlhf_trainer.data import Columns, Prompt
from rlhf_trainer.rollout.pool import EngineSlot
from rlhf_trainer.transfer import ChunkMeta, FinishedRequest, ToolActivity

Chunk = tuple[int, int, list[int]]  # (shard, engine, prompt indices), transfer.plan_chunks
ChunkJob = dict[str, Any]  # one chunk as an engine's generate_chunks reads it


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def in_request_order(chunk: int, scores: dict[int, Any], requests: int) -> list[Any]:
    """A finished chunk's request scores (refs, by request index) in request order, which is its sample
    order; raises if a request never streamed (the engine yields every request before its chunk)."""
    missing = [i for i in range(requests) if i not in scores]
    if missing or len(scores) != requests:
        raise RuntimeError(f"chunk {chunk} finished with requests {sorted(scores)}, not 0..{requests - 1}")
    return [scores[i] for i in range(requests)]


@dataclass(frozen=True)
class RaySeam:
    """The Ray calls the dispatcher makes on streams and refs (tests pass fakes: no Ray needed)."""

    wait: Callable[..., tuple[list[Any], list[Any]]] = ray.wait
    get: Callable[..., Any] = ray.get
    gone: tuple[type[BaseException], ...] = (RayActorError, ObjectLostError)  # an engine is unreachable


@dataclass
class Rollout:
    """A step's rollout, in chunk order: packed refs, chunk metas and (reward meta ref, reward result ref)."""

    packed: list[Any]
    metas: list[ChunkMeta]
    reward_calls: list[tuple[Any, Any]]


@dataclass
class ChunkDispatcher:
    """Streams one step's chunks out of `engines` (the pool's ready engines when the step started).

    `on_lost(slot, error)` is told of each engine lost (the pool marks it; the metrics count it).
    """

    step: int
    engines: Sequence[EngineSlot]
    reward: Any  # the RewardScorer actor handle
    sampling: dict[str, Any]
    on_lost: Callable[[EngineSlot, BaseException], None]
    log: Callable[[str], None] = _stderr
    ray_seam: RaySeam = field(default_factory=RaySeam)
    # engine index -> its chunks (re-dispatch reassigns)
    assigned: dict[int, list[ChunkJob]] = field(default_factory=dict)
    # open stream -> (engine index, the chunks it generates)
    streams: dict[Any, tuple[int, list[ChunkJob]]] = field(default_factory=dict)
    packed: list[Any] = field(default_factory=list)
    metas: list[ChunkMeta | None] = field(default_factory=list)
    reward_calls: list[tuple[Any, Any] | None] = field(default_factory=list)
    requests: list[int] = field(default_factory=list)  # per chunk: its requests (prompts)
    # unfinished chunk -> {request index -> the ref of its scores}, from the chunk's current generation
    request_scores: dict[int, dict[int, Any]] = field(default_factory=dict)
    lost: set[int] = field(default_factory=set)
    # chunk -> its prompts' row columns, in request order: they go to the scorer with each finished
    # request, never through the engines
    columns: dict[int, list[Columns]] = field(default_factory=dict)
    # rollout.agent: told when tool calls start (True) and stop (False) running (the `tool` phase)
    on_tool: Callable[[bool], None] | None = None
    send_columns: ClassVar[bool] = (
        False  # whether a chunk's job carries its rows' columns (an agent reads them)
    )

    def run(
        self,
        chunks: Sequence[Chunk],
        prompts: Sequence[Prompt],
        labels: Sequence[Any],
        columns: Sequence[Columns] = (),
    ) -> Rollout:
        """Generate every chunk, scoring its requests as they finish; raises if an engine returned none
        for some chunk."""
        n = len(chunks)
        self.packed, self.metas, self.reward_calls = [None] * n, [None] * n, [None] * n
        self.requests = [len(idx) for _, _, idx in chunks]
        for c, (shard, engine, idx) in enumerate(chunks):
            job = {
                "chunk": c,
                "shard": shard,
                "prompts": [prompts[i] for i in idx],
                "groups": list(idx),
                "labels": [labels[i] for i in idx],
            }
            self.columns[c] = [columns[i] for i in idx] if columns else [{} for _ in idx]
            if self.send_columns:
                job["columns"] = self.columns[c]
            self.assigned.setdefault(engine, []).append(job)
        for e, batch in self.assigned.items():
            self._launch(e, list(batch))  # a stream's own chunks: `assigned` grows when chunks move
        return self._drain()

    def scored(self) -> tuple[Rollout, list[Any]]:
        """The reward phase: every chunk's reward meta (once its requests' scores are assembled), and the
        rollout they score.

        A finished chunk's tokens live in its engine's object store. If the engine is lost after its
        stream ended, the dispatcher never saw it, and the scorer cannot read the chunk. Such a chunk is
        generated again on the engines left and scored again, like a loss mid-stream, and the step goes
        on. A scoring failure whose engine still answers is not an engine loss: it is raised.
        """
        while True:
            metas: list[Any] = []
            failed: dict[int, BaseException] = {}
            for c, call in enumerate(self.reward_calls):
                assert call is not None, f"chunk {c} was never scored"
                try:
                    metas.append(self.ray_seam.get(call[0]))
                except self.ray_seam.gone as gone:
                    owner = next(e for e, jobs in self.assigned.items() if any(j["chunk"] == c for j in jobs))
                    if owner not in failed and self._answers(owner):
                        raise
                    failed.setdefault(owner, gone)
            if not failed:
                return self._rollout(), metas
            for owner, error in failed.items():
                self._engine_lost(owner, error)
            self._drain()

    def _answers(self, e: int) -> bool:
        """Whether engine `e` still answers a call (within 30 s)."""
        try:
            self.ray_seam.get(self.engines[e].handle.ready.remote(), timeout=30)
        except self.ray_seam.gone:
            return False
        except GetTimeoutError:
            return False
        return True

    def _drain(self) -> Rollout:
        """Read the open streams to their ends; raises if an engine returned none for some chunk."""
        while self.streams:
            try:
                ready, _ = self.ray_seam.wait(list(self.streams), num_returns=1)
            except self.ray_seam.gone:
                self._find_lost_streams()  # ray.wait itself raises when a stream's actor is unreachable
                continue
            for stream in ready:
                if stream in self.streams:
                    self._read(stream)
        missing = [c for c, m in enumerate(self.metas) if m is None]
        if missing:
            raise RuntimeError(f"step {self.step}: engines returned no rollout for chunks {missing}")
        return self._rollout()

    def _rollout(self) -> Rollout:
        return Rollout(
            list(self.packed),
            [m for m in self.metas if m is not None],
            [r for r in self.reward_calls if r is not None],
        )

    def _launch(self, e: int, batch: list[ChunkJob]) -> None:
        handle = self.engines[e].handle
        sampling = {**self.sampling, "step": self.step}  # per-prompt seeds follow (seed, step, prompt)
        stream = handle.generate_chunks.options(num_returns="streaming").remote(batch, sampling)
        self.streams[stream] = (e, batch)

    def _read(self, stream: Any) -> None:
        """The next item of a ready stream: a finished request goes to the scorer at once; a finished
        chunk (its meta, then its packed ref) gets its reward assembled from its requests' scores."""
        e, batch = self.streams[stream]
        try:
            ref = next(stream)
            item: FinishedRequest | ChunkMeta | ToolActivity = self.ray_seam.get(ref)  # small: no tokens
            packed_ref = next(stream) if isinstance(item, ChunkMeta) else None
        except StopIteration:
            del self.streams[stream]
            short = [b["chunk"] for b in batch if self.metas[b["chunk"]] is None]
            if short:  # a stream that ends early: its actor died between two chunks
                self._engine_lost(e, RuntimeError(f"its stream ended without chunks {short}"))
            return
        except self.ray_seam.gone as err:
            self._engine_lost(e, err)
            return
        if isinstance(item, ToolActivity):
            if self.on_tool is not None:
                self.on_tool(item.busy)
            return
        if isinstance(item, FinishedRequest):  # the scorer reads the texts from `ref`, not from here
            scores = self.reward.score_request.remote(ref, self.columns[item.chunk][item.request])
            self.request_scores.setdefault(item.chunk, {})[item.request] = scores
            return
        c = item.chunk
        self.packed[c], self.metas[c] = packed_ref, item
        requests = in_request_order(c, self.request_scores.pop(c, {}), self.requests[c])
        self.reward_calls[c] = self.reward.assemble.options(num_returns=2).remote(c, packed_ref, *requests)

    def _find_lost_streams(self) -> None:
        """After ray.wait raised: wait on each stream alone to find the unreachable engine(s)."""
        for stream in list(self.streams):
            try:
                self.ray_seam.wait([stream], num_returns=1, timeout=0)
            except self.ray_seam.gone as err:
                if stream in self.streams:
                    self._engine_lost(self.streams[stream][0], err)

    def _engine_lost(self, e: int, err: BaseException) -> None:
        """An engine died (its pod or node is gone): the step goes on with the others.

        Every chunk it had is generated again, including the finished ones: their tokens lived in the
        lost node's object store. The scores of its requests are dropped: they scored the lost samples.
        With no engine left the step fails, and so does the attempt, which the operator restarts from the
        last checkpoint.
        """
        for stream in [s for s, (se, _) in self.streams.items() if se == e]:
            del self.streams[stream]  # nothing more is read from a lost engine's streams
        if e in self.lost:
            return
        self.lost.add(e)
        self.on_lost(self.engines[e], err)
        redo = self.assigned.pop(e, [])
        alive = [i for i in range(len(self.engines)) if i not in self.lost]
        if not alive:
            raise RuntimeError(
                f"step {self.step}: every rollout engine was lost (last: {type(err).__name__}: {err})"
            )
        for b in redo:
            self.packed[b["chunk"]] = self.metas[b["chunk"]] = self.reward_calls[b["chunk"]] = None
            self.request_scores.pop(b["chunk"], None)
        moved: dict[int, list[ChunkJob]] = {}
        for k, b in enumerate(redo):
            moved.setdefault(alive[k % len(alive)], []).append(b)
        for target, batch in moved.items():
            self.assigned.setdefault(target, []).extend(batch)
            self._launch(target, batch)
        self.log(
            f"step {self.step}: rollout engine {self.engines[e].index} lost ({type(err).__name__}); "
            f"{len(redo)} chunk(s) generated again on engine(s) {sorted(self.engines[t].index for t in moved)}"
        )


@dataclass
class AgentChunkDispatcher(ChunkDispatcher):
    """rollout.agent: the step's chunks all go to the agent runner in one stream, which runs every sample as
    an episode started on the least-loaded engine (agents.dispatch), not in static chunks, and streams back
    what an engine would (requests for the reward, then each chunk's meta and packed rollout). Scoring,
    assembly and the ranks' shards are the single-turn path's. An engine lost mid-step fails the step (the
    operator restarts it from the last checkpoint): an episode is not resumed on another engine."""

    runner: Any = None  # the AgentRunner actor handle
    send_columns: ClassVar[bool] = True

    def run(
        self,
        chunks: Sequence[Chunk],
        prompts: Sequence[Prompt],
        labels: Sequence[Any],
        columns: Sequence[Columns] = (),
    ) -> Rollout:
        one_stream = [(shard, 0, idx) for shard, _, idx in chunks]  # the runner picks engines per episode
        try:
            return super().run(one_stream, prompts, labels, columns)
        finally:  # the stream ends the tool phase itself; a failed one must not leave it in progress
            if self.on_tool is not None:
                self.on_tool(False)

    def _launch(self, e: int, batch: list[ChunkJob]) -> None:
        engines = [(slot.index, slot.handle) for slot in self.engines]
        sampling = {**self.sampling, "step": self.step}
        stream = self.runner.generate_chunks.options(num_returns="streaming").remote(batch, sampling, engines)
        self.streams[stream] = (e, batch)

    def _engine_lost(self, e: int, err: BaseException) -> None:
        raise RuntimeError(
            f"step {self.step}: agentic rollout lost its stream or an engine ({type(err).__name__}: {err})"
        ) from err
