"""Per-request dispatch of agent episodes (rlhf_trainer.agents.dispatch, episodes, tools, engine_client):
the least-loaded engine, the per-engine cap, a long episode holding no other back, tools that hang or raise
ending their episode (counted, with the reason) while the step goes on. Engines are test doubles of
controlled latency (testkit.agent_doubles); no Ray."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from typing import Any

import pytest
from rlhf_trainer.agents.contract import (
    EngineFailure,
    Episode,
    Limits,
    SamplingParams,
    Trajectory,
)
from rlhf_trainer.agents.default import single_turn
from rlhf_trainer.agents.dispatch import EpisodeDispatcher
from rlhf_trainer.agents.engine_client import BatchingEngineClient
from rlhf_trainer.agents.episodes import EpisodeJob, episode_stats, rollout_episodes
from testkit.agent_doubles import CharCodec, ScriptedEngineClient, text_reply

pytestmark = pytest.mark.unit

SAMPLING = SamplingParams(max_tokens=16)


def _episode_jobs(n: int) -> list[EpisodeJob]:
    return [EpisodeJob(i, {"prompt": f"p{i}", "i": i}, [i + 100]) for i in range(n)]


def _rollout(agent: Any, jobs: Sequence[EpisodeJob], engines: Sequence[Any], **kw: Any) -> list[Trajectory]:
    kw.setdefault("per_engine", 2)
    kw.setdefault("limits", Limits(max_turns=4, max_tokens=64))
    kw.setdefault("tool_timeout", 5.0)
    return asyncio.run(rollout_episodes(agent, jobs, engines, codec=CharCodec(), sampling=SAMPLING, **kw))


def test_the_next_item_goes_to_the_engine_with_fewest_in_flight() -> None:
    d = EpisodeDispatcher[int, int]([ScriptedEngineClient(text_reply("x"))] * 3, per_engine=3)
    d.in_flight = [2, 0, 1]
    assert d.least_loaded() == 1
    d.in_flight = [1, 1, 1]
    assert d.least_loaded() == 0  # ties: the lowest index
    d.in_flight = [3, 3, 3]
    assert d.least_loaded() is None  # every engine at its cap: the item waits


def test_a_long_episode_does_not_hold_the_others_back() -> None:
    """One long episode (1.0 s) and eight short ones (0.1 s) on two engines, one at a time each: the short
    ones all go to the engine that keeps freeing, and the step takes about the long one's time. Static
    chunks (round-robin halves) would put four short ones behind the long one: 1.4 s."""
    long, short = 1.0, 0.1
    delays = {100: long} | {100 + i: short for i in range(1, 9)}
    engines = [ScriptedEngineClient(lambda ids, _p: ([1], delays[ids[0]])) for _ in range(2)]
    d = EpisodeDispatcher[EpisodeJob, Trajectory](engines, per_engine=1)
    t0 = time.perf_counter()
    out = _rollout(single_turn, _episode_jobs(9), engines, dispatcher=d)
    elapsed = time.perf_counter() - t0
    assert [t.end_reason for t in out] == ["done"] * 9
    assert d.record.engine_of == [0] + [1] * 8, d.record
    assert elapsed < long + 2 * short + 0.05, f"{elapsed:.2f} s: the long episode held others back"


def test_each_engine_runs_at_most_its_cap_at_once_and_is_kept_full() -> None:
    engines = [ScriptedEngineClient(text_reply("ab", 0.02)) for _ in range(2)]
    d = EpisodeDispatcher[EpisodeJob, Trajectory](engines, per_engine=3)
    out = _rollout(single_turn, _episode_jobs(20), engines, dispatcher=d)
    assert len(out) == 20
    assert [e.peak for e in engines] == [3, 3]
    assert d.record.peak_in_flight == [3, 3]
    assert d.in_flight == [0, 0]
    assert sum(d.record.items_per_engine()) == 20


def test_results_come_back_in_job_order_whatever_finishes_first() -> None:
    engines = [ScriptedEngineClient(lambda ids, _p: ([ids[0]], 0.01 * (130 - ids[0]) / 10))]
    out = _rollout(single_turn, _episode_jobs(12), engines, per_engine=12)
    assert [t.prompt_ids[0] for t in out] == list(range(100, 112))
    assert [t.token_ids for t in out] == [[i] for i in range(100, 112)]


def _tool_agent(tool: Any) -> Any:
    async def agent(episode: Episode) -> Trajectory:
        await episode.generate()
        if episode.row["i"] == 0:  # only the first episode calls the tool
            value = await episode.call_tool(tool)
            episode.append_text(str(value))
        await episode.generate()
        return episode.finish(reward=1.0)

    return agent


def test_a_hanging_tool_times_out_ends_its_episode_with_the_reason_and_the_step_goes_on() -> None:
    release = threading.Event()

    def hangs() -> str:
        release.wait(30)
        return "late"

    engines = [ScriptedEngineClient(text_reply("ok", 0.01))]
    t0 = time.perf_counter()
    try:
        out = _rollout(_tool_agent(hangs), _episode_jobs(4), engines, tool_timeout=0.3)
    finally:
        release.set()
    assert time.perf_counter() - t0 < 3.0
    assert out[0].end_reason == "tool_timeout"
    assert "hangs ran past 0.3s" in out[0].detail
    assert (out[0].tool_calls, out[0].tool_errors, out[0].turns) == (1, 1, 1)
    assert out[0].valid  # the tokens so far are trained on, scored by the reward
    assert [t.end_reason for t in out[1:]] == ["done"] * 3
    assert [t.turns for t in out[1:]] == [2] * 3
    stats = episode_stats(out)
    assert (stats["tool_calls"], stats["tool_errors"], stats["end_tool_timeout"]) == (1, 1, 1)


def test_a_raising_tool_ends_its_episode_with_the_error_and_the_step_goes_on() -> None:
    def broken() -> str:
        raise KeyError("no such city")

    out = _rollout(_tool_agent(broken), _episode_jobs(3), [ScriptedEngineClient(text_reply("ok"))])
    assert out[0].end_reason == "tool_error"
    assert "KeyError" in out[0].detail and "no such city" in out[0].detail
    assert out[0].tool_errors == 1
    assert [t.end_reason for t in out[1:]] == ["done", "done"]
    assert episode_stats(out)["end_tool_error"] == 1


def test_a_working_tool_is_timed_and_its_tokens_are_masked_out() -> None:
    def slow_ok() -> int:
        time.sleep(0.05)
        return 42

    out = _rollout(_tool_agent(slow_ok), _episode_jobs(1), [ScriptedEngineClient(text_reply("ok"))])
    t = out[0]
    assert t.end_reason == "done" and t.reward == 1.0 and t.tool_calls == 1 and t.tool_errors == 0
    assert t.tool_seconds >= 0.05
    assert t.text == "ok42ok"
    assert t.loss_mask == [1, 1, 0, 0, 1, 1]
    assert t.logprobs[2:4] == [0.0, 0.0]


def test_limits_end_an_episode_with_their_reason() -> None:
    async def forever(episode: Episode) -> Trajectory:
        while True:
            await episode.generate()
            episode.append_text("t")

    engines = [ScriptedEngineClient(text_reply("abc"))]
    turns = _rollout(forever, _episode_jobs(1), engines, limits=Limits(max_turns=3, max_tokens=100))[0]
    assert (turns.end_reason, turns.turns, len(turns.token_ids)) == ("max_turns", 3, 12)
    budget = _rollout(forever, _episode_jobs(1), engines, limits=Limits(max_turns=10, max_tokens=10))[0]
    assert budget.end_reason == "token_budget"
    assert len(budget.token_ids) == 10  # 3 + 1 + 3 + 1 + a turn capped at the 2 tokens left
    assert budget.loss_mask == [1, 1, 1, 0, 1, 1, 1, 0, 1, 1]


def test_an_agent_error_marks_its_episode_invalid_but_an_engine_failure_fails_the_step() -> None:
    async def buggy(episode: Episode) -> Trajectory:
        await episode.generate()
        if episode.row["i"] == 1:
            raise ZeroDivisionError("agent bug")
        return episode.finish()

    out = _rollout(buggy, _episode_jobs(3), [ScriptedEngineClient(text_reply("x"))])
    assert [(t.end_reason, t.valid) for t in out] == [("done", True), ("agent_error", False), ("done", True)]
    assert "agent bug" in out[1].detail

    def lost(_ids: Sequence[int], _p: SamplingParams) -> tuple[list[int], float]:
        raise EngineFailure("engine 0: RayActorError")

    with pytest.raises(EngineFailure, match="RayActorError"):
        _rollout(single_turn, _episode_jobs(3), [ScriptedEngineClient(lost)])


class _SimulatedVLLM:
    """What RolloutEngine.step_tokens does, over requests that each need a scripted number of vLLM steps:
    add the new ones, step until one finishes or a slice (4 steps) passes, return the finished and the
    count still running (TEST DOUBLE of the engine's method)."""

    def __init__(self) -> None:
        self.running: dict[str, list[Any]] = {}  # id -> [steps left, prompt ids]
        self.batches: list[list[str]] = []

    async def step(self, requests: list[dict[str, Any]]) -> dict[str, Any]:
        self.batches.append([r["id"] for r in requests])
        for r in requests:
            self.running[r["id"]] = [int(r["prompt_token_ids"][0]), r["prompt_token_ids"]]
        done: list[dict[str, Any]] = []
        for _ in range(4):
            if done or not self.running:
                break
            await asyncio.sleep(0.005)
            for rid in list(self.running):
                self.running[rid][0] -= 1
                if self.running[rid][0] == 0:
                    ids = self.running.pop(rid)[1]
                    done.append(
                        {"id": rid, "token_ids": ids, "logprobs": [-0.5] * len(ids), "finish_reason": "stop"}
                    )
        return {"finished": done, "running": len(self.running)}


def test_the_batching_client_answers_each_request_when_it_finishes_and_batches_late_arrivals() -> None:
    engine = _SimulatedVLLM()
    client = BatchingEngineClient(engine.step)
    finished: list[int] = []

    async def request(steps: int, start_after: float) -> None:
        await asyncio.sleep(start_after)
        out = await client.generate([steps], SAMPLING)
        assert out.token_ids == [steps] and out.logprobs == [-0.5]
        finished.append(steps)

    async def main() -> None:
        await asyncio.gather(request(40, 0.0), request(2, 0.0), request(3, 0.02), request(4, 0.021))

    asyncio.run(main())
    assert engine.batches[0] == ["0", "1"]  # the two first requests share a call
    assert ["2", "3"] in engine.batches  # the late two join the running batch together
    assert finished == [2, 3, 4, 40]  # each answered when it finishes: the long one holds nobody back


def test_the_batching_client_fails_every_waiting_request_when_the_engine_call_fails() -> None:
    async def broken(_batch: list[dict[str, Any]]) -> dict[str, Any]:
        raise ConnectionError("actor died")

    client = BatchingEngineClient(broken, "engine 3")

    async def main() -> list[Any]:
        return await asyncio.gather(
            client.generate([1], SAMPLING), client.generate([2], SAMPLING), return_exceptions=True
        )

    errors = asyncio.run(main())
    assert all(isinstance(e, EngineFailure) and "engine 3: ConnectionError" in str(e) for e in errors)
