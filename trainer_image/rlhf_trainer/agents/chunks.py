"""A step's chunks as agent episodes: what the agent runner streams back in place of an engine's
`generate_chunks` (each prompt's `FinishedRequest` once its samples' episodes end, then each chunk's
`ChunkMeta` and `PackedRollout`), so the driver's chunk dispatcher and the reward scorer take agentic
rollouts as they take single-turn ones; `ToolActivity` marks when tool calls start and stop running.

Owns turning chunk jobs into episode jobs (the prompt row, its token ids, a seed per sample) and the
finished episodes back into chunks, in sample order. Must not choose engines (agents.dispatch) nor run
tools (agents.tools). No Ray: engines are `EngineClient`s, so unit tests drive it with doubles.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from rlhf_trainer.agents.contract import AgentFn, EngineClient, Limits, SamplingParams, TextCodec, Trajectory
from rlhf_trainer.agents.dispatch import EpisodeDispatcher
from rlhf_trainer.agents.episodes import EpisodeJob, episode_stats, rollout_episodes
from rlhf_trainer.agents.samples import pack_trajectories
from rlhf_trainer.agents.tools import ToolRunner
from rlhf_trainer.data import Prompt
from rlhf_trainer.transfer import ChunkMeta, FinishedRequest, PackedRollout, ToolActivity

# How often the stream looks at the tool pool when no episode ends: a tool running this long shows as the
# `tool` phase; calls shorter than it may go unmarked (their seconds are in the step's tool_seconds).
TOOL_TICK_SECONDS = 0.2
SEED_SPACE = 2**63  # vLLM's seeds are int64

Item = FinishedRequest | ChunkMeta | PackedRollout | ToolActivity


@dataclass(frozen=True)
class AgentSettings:
    """What the runner needs besides the chunks: rollout.agent's limits and per-engine cap, and the row's
    key names (data.inputKey, data.labelKey) to rebuild a prompt's dataset row for the agent."""

    limits: Limits
    per_engine: int
    input_key: str = "prompt"
    label_key: str | None = None
    seed: int = 0  # algorithm.seed: the samples' seeds follow (seed, step, prompt), as single-turn ones


def episode_seed(base: int, sample: int, max_turns: int) -> int:
    """The seed of a prompt's sample `sample` (its turn t draws with seed + t, agents.contract): the samples'
    turn seeds never overlap."""
    return (base + sample * max_turns) % SEED_SPACE


def row_of(prompt: Prompt, label: Any, columns: Mapping[str, Any], settings: AgentSettings) -> dict[str, Any]:
    """A prompt's dataset row as the agent reads it: every column under its own name."""
    row = {**columns, settings.input_key: prompt}
    if settings.label_key is not None:
        row[settings.label_key] = label
    return row


def episode_jobs(
    chunks: Sequence[Mapping[str, Any]],
    n: int,
    settings: AgentSettings,
    encode: Callable[[Prompt], list[int]],
    seed_of: Callable[[int], int | None],
) -> list[EpisodeJob]:
    """Every (chunk, prompt, sample) as an episode, chunk by chunk (so the first chunks finish first and
    are scored while later ones run); `index` counts them in that order. `seed_of(group)`: a prompt's base
    seed (None: unseeded)."""
    jobs: list[EpisodeJob] = []
    for ch in chunks:
        labels = ch.get("labels") or [None] * len(ch["prompts"])
        columns = ch.get("columns") or [{} for _ in ch["prompts"]]
        for i, prompt in enumerate(ch["prompts"]):
            ids = encode(prompt)
            base = seed_of(int(ch["groups"][i]))
            row = row_of(prompt, labels[i], columns[i], settings)
            for k in range(n):
                seed = None if base is None else episode_seed(base, k, settings.limits.max_turns)
                jobs.append(EpisodeJob(len(jobs), row, ids, seed))
    return jobs


def finished_request(
    chunk: int, request: int, ch: Mapping[str, Any], done: list[Trajectory]
) -> FinishedRequest:
    """A prompt's samples for the reward: the decoded trajectories, the agent's own rewards, failures."""
    labels = ch.get("labels") or [None] * len(ch["prompts"])
    return FinishedRequest(
        chunk,
        request,
        ch["prompts"][request],
        [t.text for t in done],
        labels[request],
        rewards=tuple(t.reward for t in done),
        failures=tuple("" if t.valid else f"agent_error: {t.detail}" for t in done),
    )


def packed_chunk(
    ch: Mapping[str, Any], done: list[Trajectory], n: int, engines: list[int], seconds: float
) -> tuple[ChunkMeta, PackedRollout]:
    """A chunk's trajectories (prompt-major, sample order) as its ChunkMeta and PackedRollout. Its engine:
    the one that ran most of its episodes (they went wherever a slot was free)."""
    labels = ch.get("labels") or [None] * len(ch["prompts"])
    packed = pack_trajectories(
        done,
        [int(g) for g in ch["groups"] for _ in range(n)],
        [p for p in ch["prompts"] for _ in range(n)],
        [x for x in labels for _ in range(n)],
    )
    meta = ChunkMeta(
        chunk=int(ch["chunk"]),
        rank=int(ch["shard"]),
        engine=Counter(engines).most_common(1)[0][0] if engines else -1,
        samples=packed.num_samples,
        prompt_tokens=int(packed.prompt_lens.sum()),
        response_tokens=int(packed.response_lens.sum()),
        seconds=seconds,
        digest=packed.digest(),
        agent=episode_stats(done),
    )
    return meta, packed


async def stream_chunks(
    agent: AgentFn,
    chunks: Sequence[Mapping[str, Any]],
    engines: Sequence[tuple[int, EngineClient]],
    *,
    n: int,
    sampling: SamplingParams,
    settings: AgentSettings,
    codec: TextCodec,
    tools: ToolRunner,
    encode: Callable[[Prompt], list[int]],
    seed_of: Callable[[int], int | None],
    clock: Callable[[], float],
) -> AsyncIterator[Item]:
    """Run every chunk's episodes over `engines` ((engine index, client)); yield each prompt's
    FinishedRequest when its n episodes end, a chunk's ChunkMeta then PackedRollout when all of its
    have, and a ToolActivity whenever tool calls start or stop running (checked each TOOL_TICK_SECONDS).
    An engine failure fails the stream (the step's to handle); nothing an episode survives does."""
    t0 = clock()
    jobs = episode_jobs(chunks, n, settings, encode, seed_of)
    per_chunk = [len(ch["prompts"]) * n for ch in chunks]
    starts = [sum(per_chunk[:c]) for c in range(len(chunks))]
    dispatch = EpisodeDispatcher[EpisodeJob, Trajectory]([c for _, c in engines], settings.per_engine)
    ended: asyncio.Queue[tuple[EpisodeJob, Trajectory]] = asyncio.Queue()
    run = asyncio.ensure_future(
        rollout_episodes(
            agent, jobs, dispatch.engines, per_engine=settings.per_engine, codec=codec,
            limits=settings.limits, sampling=replace(sampling, max_tokens=settings.limits.max_tokens),
            tools=tools, dispatcher=dispatch, on_done=lambda job, t: ended.put_nowait((job, t)),
        )
    )  # fmt: skip
    done: dict[int, Trajectory] = {}
    left_in_request: dict[tuple[int, int], int] = {}
    left_in_chunk = list(per_chunk)
    busy = False
    try:
        while any(left_in_chunk):
            getter = asyncio.ensure_future(ended.get())
            await asyncio.wait({getter, run}, timeout=TOOL_TICK_SECONDS, return_when="FIRST_COMPLETED")
            if (tools.running > 0) != busy:
                busy = not busy
                yield ToolActivity(busy)
            if not getter.done():  # (done after the wait returned, it holds an episode: read it below)
                getter.cancel()
                if run.done() and ended.empty():
                    run.result()  # raises the failure (an engine's)
                    raise RuntimeError("agent episodes ended without every chunk's trajectories")
                continue
            job, trajectory = getter.result()
            done[job.index] = trajectory
            c = next(k for k in range(len(chunks)) if starts[k] <= job.index < starts[k] + per_chunk[k])
            request = (job.index - starts[c]) // n
            key = (c, request)
            left_in_request[key] = left_in_request.get(key, n) - 1
            if left_in_request[key] == 0:
                first = starts[c] + request * n
                yield finished_request(
                    int(chunks[c]["chunk"]), request, chunks[c], [done[first + k] for k in range(n)]
                )
            left_in_chunk[c] -= 1
            if left_in_chunk[c] == 0:
                span = range(starts[c], starts[c] + per_chunk[c])
                engine_ids = [engines[dispatch.record.engine_of[i]][0] for i in span]
                meta, packed = packed_chunk(chunks[c], [done[i] for i in span], n, engine_ids, clock() - t0)
                yield meta
                yield packed
        await run
    finally:
        if not run.done():
            run.cancel()
    if busy:
        yield ToolActivity(False)
