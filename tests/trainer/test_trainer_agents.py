"""The agent contract (rlhf_trainer.agents.contract, default, samples) and the calculator example
(examples/agents/calculator.py): the default agent gives exactly today's packed rollout, agent functions
load like reward functions, trajectories are checked, the calculator evaluates arithmetic only."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from rlhf_trainer.agents.contract import (
    AgentSetupError,
    Episode,
    Limits,
    SamplingParams,
    Trajectory,
    load_agent_function,
)
from rlhf_trainer.agents.default import DEFAULT_AGENT, single_turn
from rlhf_trainer.agents.episodes import EpisodeJob, rollout_episodes
from rlhf_trainer.agents.samples import pack_trajectories
from rlhf_trainer.rollout.engine import RolloutEngine
from testkit.agent_doubles import CharCodec, ScriptedEngineClient

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
CALCULATOR = f"{ROOT / 'examples' / 'agents' / 'calculator.py'}:run_episode"


def _vllm_output(token_ids: list[int], finish: str) -> Any:
    """A vLLM RequestOutput as RolloutEngine._pack reads it (one completion, logprobs=0)."""
    lps = [{t: SimpleNamespace(logprob=-(k + 1) / 100)} for k, t in enumerate(token_ids)]
    comp = SimpleNamespace(
        token_ids=token_ids, logprobs=lps, text=CharCodec().decode(token_ids), finish_reason=finish
    )
    return SimpleNamespace(outputs=[comp])


def test_the_default_agent_gives_exactly_todays_packed_rollout() -> None:
    """Three prompts, one sample each: the engine's own packing of vLLM's outputs (today) and the default
    agent's trajectories packed by agents.samples hold the same tensors, texts and finished flags; every
    response token is a model token."""
    prompts = ["ab", "cde", "f"]
    replies = {"ab": "xyz", "cde": "q" * 8, "f": "ok"}  # "q" * 8 reaches max_tokens: length, not stop
    codec = CharCodec()
    prompt_ids = {(0, i): codec.encode(p) for i, p in enumerate(prompts)}
    chunk = {"chunk": 0, "shard": 0, "prompts": prompts, "groups": [0, 1, 2], "labels": None}
    outs = {
        i: _vllm_output(codec.encode(replies[p]), "length" if len(replies[p]) == 8 else "stop")
        for i, p in enumerate(prompts)
    }
    _, today = RolloutEngine._pack(SimpleNamespace(index=0), chunk, outs, prompt_ids, 0.0)  # type: ignore[arg-type]

    client = ScriptedEngineClient(lambda ids, _p: (codec.encode(replies[codec.decode(ids)]), 0.0))
    jobs = [EpisodeJob(i, {"prompt": p}, codec.encode(p)) for i, p in enumerate(prompts)]
    trajectories = asyncio.run(
        rollout_episodes(
            single_turn, jobs, [client], per_engine=4, codec=codec,
            limits=Limits(max_turns=1, max_tokens=8), sampling=SamplingParams(max_tokens=8), tool_timeout=1.0,
        )
    )  # fmt: skip
    agentic = pack_trajectories(trajectories, [0, 1, 2], prompts)
    for name in ("tokens", "seq_lens", "prompt_lens", "group", "rollout_logprobs"):
        assert torch.equal(getattr(agentic, name), getattr(today, name)), name
    assert (agentic.prompts, agentic.responses, agentic.finished) == (
        today.prompts,
        today.responses,
        today.finished,
    )
    assert agentic.finished == [True, False, True]
    assert agentic.loss_mask is not None
    assert torch.equal(agentic.loss_mask, torch.ones(int(today.response_lens.sum())))
    assert torch.equal(agentic.model_lens, today.response_lens)
    assert [(t.turns, t.tool_calls, t.end_reason) for t in trajectories] == [(1, 0, "done")] * 3


def test_a_seeded_episode_draws_each_turn_from_its_own_seed() -> None:
    async def two_turns(episode: Episode) -> Trajectory:
        await episode.generate()
        await episode.generate(temperature=0.5)
        return episode.finish()

    client = ScriptedEngineClient(lambda _ids, _p: ([7], 0.0))
    jobs = [EpisodeJob(0, {}, [1], seed=1000)]
    asyncio.run(
        rollout_episodes(
            two_turns, jobs, [client], per_engine=1, codec=CharCodec(), limits=Limits(2, 10),
            sampling=SamplingParams(max_tokens=4), tool_timeout=1.0,
        )
    )  # fmt: skip
    (ids0, p0), (ids1, p1) = client.calls
    assert (ids0, ids1) == ([1], [1, 7])  # the second turn continues the whole conversation, token ids
    assert (p0.seed, p1.seed, p0.temperature, p1.temperature) == (1000, 1001, 1.0, 0.5)


def test_agent_functions_load_like_reward_functions(tmp_path: Path) -> None:
    assert load_agent_function(DEFAULT_AGENT) is single_turn
    assert load_agent_function(CALCULATOR).__name__ == "run_episode"
    sync = tmp_path / "sync_agent.py"
    sync.write_text("def agent(episode):\n    return None\n")
    with pytest.raises(AgentSetupError, match=r"rollout\.agent .*must be an async function"):
        load_agent_function(f"{sync}:agent")
    for ref, needle in [("nope", "expected 'module:function'"), ("no_such_mod_xyz:f", "no_such_mod_xyz"),
                        (f"{tmp_path}/missing.py:f", "does not exist"), (f"{DEFAULT_AGENT}x", "no callable")]:  # fmt: skip
        with pytest.raises(AgentSetupError, match=r"rollout\.agent") as e:
            load_agent_function(ref)
        assert needle in str(e.value)


def test_a_trajectory_refuses_misaligned_tokens_masks_and_logprobs() -> None:
    with pytest.raises(ValueError, match="3 token ids, 2 mask entries"):
        Trajectory([1], [1, 2, 3], [1, 0], [0.0, 0.0, 0.0])
    with pytest.raises(ValueError, match=r"0 \(tool\) and 1 \(model\) only"):
        Trajectory([1], [1], [2], [0.0])
    with pytest.raises(ValueError, match="unknown end reason"):
        Trajectory([1], [], [], [], end_reason="crashed")


@pytest.fixture(scope="module")
def calculator() -> Any:
    from rlhf_trainer.user_code import load_callable

    return load_callable(CALCULATOR.replace(":run_episode", ":calculate"), "test")


@pytest.mark.parametrize(
    "expression, value",
    [("2+3", 5), (" 7 * (4 - 1) ", 21), ("-2**3", -8), ("10/4", 2.5), ("17 // 5 % 3", 0), ("1.5e2+1", 151.0)],
)
def test_the_calculator_evaluates_arithmetic(calculator: Any, expression: str, value: float) -> None:
    assert calculator(expression) == value


@pytest.mark.parametrize(
    "expression",
    [
        "__import__('os').system('true')",
        "open('/etc/passwd').read()",
        "(1).__class__",
        "x + 1",
        "[1, 2]",
        "'a' * 3",
        "2 ** 1000000",
        "9 ** 9 ** 9 ** 9",
        "lambda: 1",
        "1 if True else 2",
        "True + 1",
        "2 +",
        "1" * 300,
    ],
)
def test_the_calculator_refuses_anything_but_arithmetic(calculator: Any, expression: str) -> None:
    with pytest.raises(ValueError):
        calculator(expression)


def test_the_calculator_agent_appends_the_result_as_tool_tokens_and_generates_again() -> None:
    codec = CharCodec()
    turns = iter(["Let me see <calc>2+3</calc>", " so 5.", "never"])
    client = ScriptedEngineClient(lambda _ids, _p: (codec.encode(next(turns)), 0.0))
    (t,) = asyncio.run(
        rollout_episodes(
            load_agent_function(CALCULATOR), [EpisodeJob(0, {}, codec.encode("Q:"))], [client],
            per_engine=1, codec=codec, limits=Limits(4, 200), sampling=SamplingParams(max_tokens=50),
            tool_timeout=5.0,
        )
    )  # fmt: skip
    assert t.text == "Let me see <calc>2+3</calc><result>5</result> so 5."
    assert (t.turns, t.tool_calls, t.tool_errors, t.end_reason) == (2, 1, 0, "done")
    first, tool = len("Let me see <calc>2+3</calc>"), len("<result>5</result>")
    assert t.loss_mask == [1] * first + [0] * tool + [1] * len(" so 5.")
    assert client.calls[0][1].stop == ("</calc>",)
    assert client.calls[1][0] == codec.encode("Q:" + t.text[: first + tool])  # token in: the whole context


def test_the_calculator_agent_answers_a_bad_expression_with_an_error_result() -> None:
    codec = CharCodec()
    turns = iter(["<calc>os.system(1)</calc>", "hm"])
    client = ScriptedEngineClient(lambda _ids, _p: (codec.encode(next(turns)), 0.0))
    (t,) = asyncio.run(
        rollout_episodes(
            load_agent_function(CALCULATOR), [EpisodeJob(0, {}, [1])], [client], per_engine=1, codec=codec,
            limits=Limits(4, 200), sampling=SamplingParams(max_tokens=50), tool_timeout=5.0,
        )
    )  # fmt: skip
    assert t.text == "<calc>os.system(1)</calc><result>error</result>hm"
    assert (t.tool_calls, t.tool_errors, t.end_reason) == (1, 1, "done")
