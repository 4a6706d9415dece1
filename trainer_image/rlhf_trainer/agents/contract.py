"""The agent contract: what a user's agent function receives (an `Episode`: the prompt row, its token ids,
an engine client, a tool runner, limits) and what an episode yields (a `Trajectory`: token ids with a loss
mask and the engine's log-probs, token in and token out).

Owns the types every part of agentic rollout agrees on and loading an agent function from the spec. Must
not import Ray or vLLM: engines are reached through the `EngineClient` protocol, so everything here runs
in unit tests with a test double.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from rlhf_trainer.metrics import AGENT_END_REASONS
from rlhf_trainer.user_code import load_callable

# Why an episode ended. `done`: the agent finished; `max_turns` / `token_budget`: a limit stopped it (an
# `EpisodeLimit` the agent let through); `tool_timeout` / `tool_error`: a tool failed (ToolFailure);
# `agent_error`: the agent function itself raised (the trajectory is marked invalid and counted).
# (The label values of rlhf_agent_episodes_total{end_reason}: one tuple, in metrics.)
END_REASONS = AGENT_END_REASONS


@dataclass(frozen=True)
class SamplingParams:
    """One generation call's sampling: what vLLM's SamplingParams gets (logprobs of the sampled token are
    always returned). `seed` None: the engine's own randomness."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()  # stop strings, kept in the output (the model sampled them)
    stop_token_ids: tuple[int, ...] = ()

    def wire(self) -> dict[str, Any]:
        """The dict an engine's `step_tokens` reads (Ray moves plain data)."""
        return {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
            "stop": list(self.stop),
            "stop_token_ids": list(self.stop_token_ids),
        }


@dataclass(frozen=True)
class Generation:
    """What one generation call returns: the sampled token ids, each one's log-prob under the sampling
    distribution (vLLM's processed log-probs, what the trainer's ratio is taken against), and why it
    stopped (`stop`: EOS or a stop string/token; `length`: max_tokens)."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(f"{len(self.token_ids)} token ids but {len(self.logprobs)} log-probs")


class EngineClient(Protocol):
    """A rollout engine, token in and token out: never text, so the trainer scores exactly the tokens the
    engine sampled (re-tokenising decoded text may split it differently)."""

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generation: ...


class TextCodec(Protocol):
    """Text <-> token ids for what the agent adds (tool output, environment turns) and reads (a model
    turn's text, to find a tool call). Model tokens are never encoded back: they stay the sampled ids."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ToolCaller(Protocol):
    """Runs a tool off the event loop with a timeout (agents.tools.ToolRunner); raises ToolFailure."""

    async def call(self, fn: Callable[..., Any], *args: Any) -> tuple[Any, float]: ...


@dataclass(frozen=True)
class Limits:
    """rollout.agent's limits per episode: model turns, and tokens after the prompt (model and tool tokens
    together: the whole sequence must fit the trainer's and the engine's context)."""

    max_turns: int = 1
    max_tokens: int = 1024

    def __post_init__(self) -> None:
        if self.max_turns < 1 or self.max_tokens < 1:
            raise ValueError(f"agent limits must be positive: {self}")


class EpisodeLimit(Exception):
    """A limit ended the episode (`reason`: max_turns or token_budget). Agents may let it propagate: the
    dispatcher ends the episode with that reason, keeping every token so far."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class EngineFailure(RuntimeError):
    """An engine client could not generate (its engine is lost or broken): the step's failure, never an
    episode's. Engine clients raise it; an agent must let it through."""


class ToolFailure(Exception):
    """A tool raised or ran past its timeout (`reason`: tool_error or tool_timeout). It ends the episode,
    never the step."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class Trajectory:
    """One finished episode, as the trainer takes it.

    prompt_ids: the initial prompt (never trained on). token_ids: everything after it, in order; loss_mask
    (same length): 1 for a token the model sampled, 0 for a token a tool or the environment added; logprobs
    (same length): the engine's log-prob for model tokens, 0.0 for the others (masked out). `valid` False:
    the agent itself failed; the sample is kept out of the loss like a failed reward.
    """

    prompt_ids: list[int]
    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    reward: float | None = None
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_seconds: float = 0.0
    end_reason: str = "done"
    finished: bool = False  # the last model turn stopped by itself (EOS/stop), not by a length limit
    valid: bool = True
    detail: str = ""  # the failure's message, for an end reason other than done
    text: str = ""  # the decoded token_ids, for a reward function that reads text

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if len(self.loss_mask) != n or len(self.logprobs) != n:
            raise ValueError(
                f"trajectory: {n} token ids, {len(self.loss_mask)} mask entries, {len(self.logprobs)} log-probs"
            )
        if any(m not in (0, 1) for m in self.loss_mask):
            raise ValueError("trajectory: the loss mask holds 0 (tool) and 1 (model) only")
        if self.end_reason not in END_REASONS:
            raise ValueError(f"trajectory: unknown end reason {self.end_reason!r}")

    @property
    def model_tokens(self) -> int:
        return sum(self.loss_mask)


@dataclass
class Episode:
    """What an agent function drives: one prompt row, one engine (every turn goes to the same engine, so its
    prefix cache holds the conversation), its limits; it accumulates the trajectory as the agent generates
    and appends. `row` holds every column of the prompt's dataset row."""

    row: Mapping[str, Any]
    prompt_ids: list[int]
    client: EngineClient
    codec: TextCodec
    tools: ToolCaller
    limits: Limits
    sampling: SamplingParams
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_seconds: float = 0.0
    last_finish: str = ""

    @property
    def context_ids(self) -> list[int]:
        """The whole conversation so far (what the next generation continues)."""
        return self.prompt_ids + self.token_ids

    @property
    def tokens_left(self) -> int:
        return self.limits.max_tokens - len(self.token_ids)

    async def generate(self, **overrides: Any) -> Generation:
        """One model turn from the conversation so far; its tokens join the trajectory with mask 1. Raises
        EpisodeLimit when no turn or token is left. `overrides`: SamplingParams fields for this turn (a
        turn's max_tokens is also capped by the tokens left)."""
        if self.turns >= self.limits.max_turns:
            raise EpisodeLimit("max_turns")
        if self.tokens_left <= 0:
            raise EpisodeLimit("token_budget")
        params = replace(self.sampling, **overrides)
        if params.seed is not None:  # each turn its own draw, reproducible from the episode's seed
            params = replace(params, seed=params.seed + self.turns)
        params = replace(params, max_tokens=min(params.max_tokens, self.tokens_left))
        out = await self.client.generate(self.context_ids, params)
        self.turns += 1
        self.token_ids += out.token_ids
        self.loss_mask += [1] * len(out.token_ids)
        self.logprobs += out.logprobs
        self.last_finish = out.finish_reason
        return out

    def append(self, ids: Sequence[int]) -> None:
        """Tool or environment tokens (mask 0). Past the token budget the rest is cut and EpisodeLimit
        raised: a sequence longer than the budget would not fit the trainer's context."""
        take = list(ids)[: max(self.tokens_left, 0)]
        self.token_ids += take
        self.loss_mask += [0] * len(take)
        self.logprobs += [0.0] * len(take)
        if len(take) < len(ids):
            raise EpisodeLimit("token_budget")

    def append_text(self, text: str) -> None:
        self.append(self.codec.encode(text))

    async def call_tool(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` in the tool pool with its timeout; counted. Raises ToolFailure (which ends the
        episode unless the agent catches it and goes on)."""
        self.tool_calls += 1
        try:
            value, seconds = await self.tools.call(fn, *args)
        except ToolFailure:
            self.tool_errors += 1
            raise
        self.tool_seconds += seconds
        return value

    def finish(self, reward: float | None = None, end_reason: str = "done", detail: str = "") -> Trajectory:
        """The trajectory so far, ended for `end_reason`."""
        return Trajectory(
            prompt_ids=list(self.prompt_ids),
            token_ids=list(self.token_ids),
            loss_mask=list(self.loss_mask),
            logprobs=list(self.logprobs),
            reward=reward,
            turns=self.turns,
            tool_calls=self.tool_calls,
            tool_errors=self.tool_errors,
            tool_seconds=self.tool_seconds,
            end_reason=end_reason,
            finished=self.last_finish == "stop",
            valid=end_reason != "agent_error",
            detail=detail,
            text=self.codec.decode(self.token_ids),
        )


# An agent function: drives one episode and returns its trajectory (usually `episode.finish(reward)`).
AgentFn = Callable[[Episode], Awaitable[Trajectory]]


class AgentSetupError(ValueError):
    """rollout.agent names no loadable agent function."""


def load_agent_function(ref: str) -> AgentFn:
    """`module:function` or `path/file.py:function` (as model.reward.function) -> the agent function, or
    AgentSetupError. It must be an `async def`: episodes run concurrently on one event loop."""
    import inspect

    fn = load_callable(ref, "rollout.agent", AgentSetupError)
    if not inspect.iscoroutinefunction(fn):
        raise AgentSetupError(f"rollout.agent {ref!r}: {fn.__name__} must be an async function")
    return fn
