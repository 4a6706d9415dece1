"""Agentic rollout wired into the step (issue 37 item 2): the driver's chunk dispatcher sends the step's
chunks to the agent runner in one stream (`AgentChunkDispatcher`), the runner's chunk stream
(`agents.chunks.stream_chunks`) runs every sample as an episode over the engines and streams back what an
engine would (each prompt's request for the reward, each chunk's meta and packed rollout with its loss
mask) and when tools start and stop running; the reward scorer takes an agent's own reward and counts a
failed agent as a reward error; the tool pool waits for a free worker before a call's timeout starts.
Engines are test doubles (testkit.agent_doubles) and Ray is a fake seam (as in test_trainer_dispatch)."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from rlhf_trainer.agents.chunks import AgentSettings, episode_seed, stream_chunks
from rlhf_trainer.agents.contract import Episode, Limits, SamplingParams, ToolFailure, Trajectory
from rlhf_trainer.agents.episodes import episode_stats, merge_stats
from rlhf_trainer.agents.tools import ToolRunner
from rlhf_trainer.rollout.dispatch import AgentChunkDispatcher, RaySeam
from rlhf_trainer.rollout.pool import EngineSlot
from rlhf_trainer.transfer import ChunkMeta, FinishedRequest, PackedRollout, ToolActivity, plan_chunks
from rlhf_trainer.workers.reward import RewardScorer
from testkit.agent_doubles import CharCodec, ScriptedEngineClient, text_reply

pytestmark = pytest.mark.unit
CODEC = CharCodec()
N = 2  # samples per prompt


async def calc_agent(episode: Episode) -> Trajectory:
    """Prompt "pK": K tool calls (each appends "=4", 0.25 s: longer than the stream's tool tick), then a last turn; prompt "p3" fails itself;
    sample seeds are kept as the reward so the test can read them back."""
    k = int(str(episode.row["prompt"])[1:])
    await episode.generate()
    if k == 3:
        raise ValueError("agent bug")
    for _ in range(k % 3):
        value = await episode.call_tool(lambda: time.sleep(0.25) or 4)
        episode.append_text(f"={value}")
        await episode.generate()
    return episode.finish(reward=None if k % 2 else float(episode.sampling.seed or 0))


class FakeRunner:
    """The AgentRunner actor handle: `generate_chunks.options(...).remote(batch, sampling, engines)` runs the
    real chunk stream over engine doubles and returns its items as refs (("item", x); a packed rollout as
    ("packed", x), which the dispatcher passes on unread)."""

    def __init__(self, clients: dict[int, ScriptedEngineClient]) -> None:
        self.clients = clients
        self.calls: list[tuple[list[dict[str, Any]], dict[str, Any], list[tuple[int, Any]]]] = []
        self.generate_chunks = self

    def options(self, **_: Any) -> FakeRunner:
        return self

    def remote(
        self, batch: list[dict[str, Any]], sampling: dict[str, Any], engines: list[tuple[int, Any]]
    ) -> Any:
        self.calls.append((batch, sampling, engines))
        settings = AgentSettings(Limits(max_turns=4, max_tokens=32), per_engine=2, label_key="answer")

        async def collect() -> list[Any]:
            stream = stream_chunks(
                calc_agent, batch, [(i, self.clients[i]) for i, _ in engines], n=int(sampling["n"]),
                sampling=SamplingParams(max_tokens=99), settings=settings, codec=CODEC, tools=ToolRunner(2, 5.0),
                encode=CODEC.encode, seed_of=lambda g: 1000 * g, clock=time.monotonic,
            )  # fmt: skip
            return [item async for item in stream]

        return iter(
            [("packed", x) if isinstance(x, PackedRollout) else ("item", x) for x in asyncio.run(collect())]
        )


class FakeScorer:
    def __init__(self) -> None:
        self.requests: list[tuple[FinishedRequest, dict[str, Any]]] = []
        self.packed: dict[int, PackedRollout] = {}
        self.score_request = self
        self.assemble = Assemble(self)

    def remote(self, ref: tuple[str, FinishedRequest], columns: dict[str, Any]) -> Any:
        self.requests.append((ref[1], columns))
        return ("scores", ref[1].chunk)


class Assemble:
    def __init__(self, scorer: FakeScorer) -> None:
        self.scorer = scorer

    def options(self, **_: Any) -> Assemble:
        return self

    def remote(self, chunk: int, packed_ref: tuple[str, PackedRollout], *requests: Any) -> tuple[Any, Any]:
        self.scorer.packed[chunk] = packed_ref[1]
        return ("meta", chunk), ("result", chunk)


def seam() -> RaySeam:
    def get(ref: tuple[str, Any], timeout: float | None = None) -> Any:
        assert ref[0] == "item", "the dispatcher fetched a packed rollout (tokens) into the driver"
        return ref[1]

    return RaySeam(wait=lambda streams, num_returns=1, timeout=None: (streams[:1], streams[1:]), get=get)


def run_step(prompts: list[str]) -> tuple[AgentChunkDispatcher, Any, FakeRunner, FakeScorer, list[bool]]:
    clients = {
        7: ScriptedEngineClient(text_reply("ab", 0.01)),
        9: ScriptedEngineClient(text_reply("ab", 0.01)),
    }
    runner, scorer, tool_marks = FakeRunner(clients), FakeScorer(), []
    slots = [EngineSlot(index=i, handle=f"engine-{i}", state="ready") for i in clients]
    d = AgentChunkDispatcher(
        step=5, engines=slots, reward=scorer, sampling={"n": N}, on_lost=lambda s, e: None,
        ray_seam=seam(), on_tool=tool_marks.append, runner=runner,
    )  # fmt: skip
    chunks = plan_chunks(len(prompts), 2, len(slots))
    columns = [{"answer": i, "source": "s"} for i in range(len(prompts))]
    rollout = d.run(chunks, prompts, [f"label{i}" for i in range(len(prompts))], columns)
    return d, rollout, runner, scorer, tool_marks


def test_the_step_goes_to_the_agent_runner_in_one_stream_over_every_engine() -> None:
    prompts = [f"p{k}" for k in (0, 1, 2, 4)]
    _, rollout, runner, scorer, tool_marks = run_step(prompts)
    assert len(runner.calls) == 1, "one stream: the runner chooses engines per episode"
    batch, sampling, engines = runner.calls[0]
    assert engines == [(7, "engine-7"), (9, "engine-9")]
    assert sampling["step"] == 5 and sampling["n"] == N
    assert [job["chunk"] for job in batch] == [0, 1, 2, 3]
    assert all(job["columns"] == [{"answer": i, "source": "s"} for i in job["groups"]] for job in batch)
    # the reward gets each prompt's samples, with its row's columns, as for single-turn chunks
    assert sorted((r.chunk, r.request) for r, _ in scorer.requests) == [(c, 0) for c in range(4)]
    assert all(
        cols == {"answer": r.chunk // 2 + 2 * (r.chunk % 2), "source": "s"} for r, cols in scorer.requests
    )
    # tools ran (prompts p1, p2, p4): the `tool` phase was marked, and unmarked at the end
    assert tool_marks and tool_marks[0] is True and tool_marks[-1] is False
    metas = rollout.metas
    assert [m.chunk for m in metas] == [0, 1, 2, 3] and all(m.engine in (7, 9) for m in metas)
    calls = {c: 0 if p == "p0" else (1 if p in ("p1", "p4") else 2) for c, p in enumerate(prompts)}
    chunk_prompt = {job["chunk"]: prompts[job["groups"][0]] for job in batch}
    for m in metas:
        k = int(chunk_prompt[m.chunk][1:]) % 3
        assert m.agent["tool_calls"] == N * k and m.agent["turns_mean"] == 1 + k
        assert m.generated_tokens == m.response_tokens - m.agent["tool_tokens"]
    assert sum(calls.values()) * N == sum(m.agent["tool_calls"] for m in metas)


def test_the_runner_packs_each_chunk_with_its_loss_mask_in_sample_order() -> None:
    _, _, runner, scorer, _ = run_step(["p2", "p0", "p1", "p3"])
    batch = runner.calls[0][0]
    for job in batch:
        packed = scorer.packed[job["chunk"]]
        assert packed.num_samples == N * len(job["prompts"])
        assert packed.group.tolist() == [g for g in job["groups"] for _ in range(N)]
        assert packed.labels == [f"label{g}" for g in job["groups"] for _ in range(N)]
        assert packed.loss_mask is not None
        k = int(job["prompts"][0][1:])
        per_sample = torch.split(packed.model_mask(), packed.response_lens.tolist())
        want = {0: [1, 1], 1: [1, 1, 0, 0, 1, 1], 2: [1, 1, 0, 0, 1, 1, 0, 0, 1, 1], 3: [1, 1]}[k]
        assert all(m.tolist() == want for m in per_sample), (k, per_sample)
        assert packed.responses == [{0: "ab", 1: "ab=4ab", 2: "ab=4ab=4ab", 3: "ab"}[k]] * N


def test_each_request_carries_the_agents_rewards_and_failures_for_the_scorer() -> None:
    *_, scorer, _ = run_step(["p2", "p0", "p1", "p3"])
    by_prompt = {str(r.prompt): r for r, _ in scorer.requests}
    base = {g: 1000 * g for g in range(4)}
    # even prompts return their own reward (here: each sample's seed, spaced by maxTurns); odd ones none
    assert by_prompt["p2"].rewards == tuple(float(episode_seed(base[0], k, 4)) for k in range(N))
    assert by_prompt["p0"].rewards == tuple(float(episode_seed(base[1], k, 4)) for k in range(N))
    assert by_prompt["p1"].rewards == (None,) * N and by_prompt["p1"].failures == ("",) * N
    assert all(f.startswith("agent_error: ValueError: agent bug") for f in by_prompt["p3"].failures)


def _scorer(tmp_path: Path) -> RewardScorer:
    fn = tmp_path / "reward.py"
    fn.write_text("def reward(prompts, responses):\n    return [float(len(r)) for r in responses]\n")
    return RewardScorer(
        {"type": "function", "function": f"{fn}:reward", "timeout_seconds": 5.0, "concurrency": 2}
    )


def test_the_scorer_takes_the_agents_reward_scores_the_rest_and_counts_failed_agents(tmp_path: Path) -> None:
    scorer = _scorer(tmp_path)
    request = FinishedRequest(
        0, 1, "p", ["abc", "de", "f", "ghij"], None,
        rewards=(0.25, None, None, float("nan")), failures=("", "", "agent_error: KeyError: x", ""),
    )  # fmt: skip
    got = scorer.score_request(request)
    assert got.scores == [0.25, 2.0, None, None]  # own, the job's reward, failed agent, bad own reward
    assert any("agent_error: KeyError: x" in m for m in got.messages)
    assert any("non-finite" in m for m in got.messages)
    plain = scorer.score_request(FinishedRequest(0, 2, "p", ["abc", "de"]))
    assert plain.scores == [3.0, 2.0] and plain.messages == []


def test_a_tool_call_waits_for_a_free_worker_before_its_timeout_starts() -> None:
    """Two workers, six calls of 0.2 s, timeout 0.3 s: each call waits behind the others for a worker
    (0.6 s in all) but none times out, its time counted from its start."""
    tools = ToolRunner(threads=2, timeout=0.3)

    async def main() -> list[tuple[Any, float]]:
        return await asyncio.gather(*(tools.call(lambda i=i: time.sleep(0.2) or i) for i in range(6)))

    t0 = time.monotonic()
    out = asyncio.run(main())
    assert [v for v, _ in out] == list(range(6))
    assert all(0.19 <= s < 0.3 for _, s in out)
    assert time.monotonic() - t0 >= 0.55
    assert (tools.running, tools.held) == (0, 0)


def test_workers_held_by_hung_tools_fail_new_calls_at_once_until_they_return() -> None:
    release = threading.Event()
    tools = ToolRunner(threads=1, timeout=0.1)

    async def main() -> list[str]:
        reasons = []
        for fn in (lambda: release.wait(10), lambda: 1):
            try:
                await tools.call(fn)
            except ToolFailure as e:
                reasons.append(e.reason + ": " + e.detail)
        release.set()
        await asyncio.sleep(0.1)  # the hung call returns: its worker is free again
        value, _ = await tools.call(lambda: 2)
        return [*reasons, str(value)]

    out = asyncio.run(main())
    assert out[0].startswith("tool_timeout: ") and "ran past 0.1s" in out[0]
    assert out[1] == "tool_timeout: all 1 tool workers hold calls that timed out"
    assert out[2] == "2" and (tools.running, tools.held) == (0, 0)


def test_the_steps_episode_figures_merge_over_chunks() -> None:
    def t(turns: int, calls: int, errors: int) -> Trajectory:
        return Trajectory([1], [2, 3], [1, 0], [0.0, 0.0], turns=turns, tool_calls=calls, tool_errors=errors,
                          tool_seconds=0.5 * calls)  # fmt: skip

    a, b = episode_stats([t(1, 0, 0), t(3, 2, 1)]), episode_stats([t(2, 1, 0)])
    merged = merge_stats([a, {}, b])
    assert merged["episodes"] == 3 and merged["turns_mean"] == pytest.approx(2.0) and merged["turns_max"] == 3
    assert (merged["tool_calls"], merged["tool_errors"], merged["tool_seconds"]) == (3, 1, 1.5)
    assert merged["tool_tokens"] == 3 and merged["model_tokens"] == 3
    assert merge_stats([{}, {}]) == {}


def test_tool_activity_and_metas_are_small_and_carry_no_tokens() -> None:
    meta = ChunkMeta(0, 0, 7, 2, 3, 10, 0.1, agent={"tool_tokens": 4.0})
    assert meta.generated_tokens == 6 and ChunkMeta(0, 0, 7, 2, 3, 10, 0.1).generated_tokens == 10
    assert ToolActivity(True).busy
