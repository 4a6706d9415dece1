"""One step's agentic rollout: every (prompt, sample) an episode of the user's agent function, dispatched
per request over the engines, tools in a shared pool.

Owns running an agent function on an `Episode` and turning what ends it early (a limit, a failing tool,
the agent's own error) into a trajectory with its end reason, so only an engine failure fails the step;
and the step's episode statistics (turns, tool calls, errors and seconds: the step report's). Must not
choose engines (agents.dispatch does) nor build trainer samples (agents.samples does).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from rlhf_trainer.agents.contract import (
    END_REASONS,
    AgentFn,
    EngineClient,
    EngineFailure,
    Episode,
    EpisodeLimit,
    Limits,
    SamplingParams,
    TextCodec,
    ToolFailure,
    Trajectory,
)
from rlhf_trainer.agents.dispatch import EpisodeDispatcher
from rlhf_trainer.agents.tools import ToolRunner


@dataclass(frozen=True)
class EpisodeJob:
    """One episode to run: its place in the step (`index`: sample order), the prompt's dataset row, the
    prompt's token ids, its sampling seed (None: unseeded)."""

    index: int
    row: Mapping[str, Any]
    prompt_ids: list[int]
    seed: int | None = None


async def run_episode(agent: AgentFn, episode: Episode) -> Trajectory:
    """The agent's trajectory; a limit, a tool failure or the agent's own exception ends the episode with
    that reason and every token so far (an agent error also marks it invalid). EngineFailure propagates."""
    try:
        return await agent(episode)
    except EngineFailure:
        raise
    except EpisodeLimit as limit:
        return episode.finish(end_reason=limit.reason)
    except ToolFailure as failure:
        return episode.finish(end_reason=failure.reason, detail=failure.detail)
    except Exception as e:
        return episode.finish(end_reason="agent_error", detail=f"{type(e).__name__}: {e}")


async def rollout_episodes(
    agent: AgentFn,
    jobs: Sequence[EpisodeJob],
    engines: Sequence[EngineClient],
    *,
    per_engine: int,
    codec: TextCodec,
    limits: Limits,
    sampling: SamplingParams,
    tool_timeout: float = 30.0,
    tools: ToolRunner | None = None,
    dispatcher: EpisodeDispatcher[EpisodeJob, Trajectory] | None = None,
    on_done: Callable[[EpisodeJob, Trajectory], None] | None = None,
) -> list[Trajectory]:
    """Every job's trajectory, in job order; `on_done(job, trajectory)` as each one ends. `tools`: the
    pool the episodes share (the agent runner keeps one across steps); None: a pool of this call's own,
    a worker per episode that can run at once, `tool_timeout` each."""
    dispatch = dispatcher or EpisodeDispatcher[EpisodeJob, Trajectory](engines, per_engine)
    pool = tools or ToolRunner(threads=len(dispatch.engines) * dispatch.per_engine, timeout=tool_timeout)

    async def work(client: EngineClient, job: EpisodeJob) -> Trajectory:
        episode = Episode(
            row=job.row,
            prompt_ids=list(job.prompt_ids),
            client=client,
            codec=codec,
            tools=pool,
            limits=limits,
            sampling=replace(sampling, seed=job.seed),
        )
        trajectory = await run_episode(agent, episode)
        if on_done is not None:
            on_done(job, trajectory)
        return trajectory

    try:
        return await dispatch.run(jobs, work)
    finally:
        if tools is None:
            pool.shutdown()


def merge_stats(parts: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Chunks' episode_stats as one step's: totals added, turns_mean weighted by episodes, turns_max the
    largest. Empty when no part has any (a step without agents)."""
    parts = [p for p in parts if p]
    if not parts:
        return {}
    out: dict[str, float] = {}
    for p in parts:
        for k, v in p.items():
            out[k] = max(out.get(k, 0.0), v) if k == "turns_max" else out.get(k, 0.0) + v
    episodes = sum(p["episodes"] for p in parts)
    out["turns_mean"] = sum(p["turns_mean"] * p["episodes"] for p in parts) / max(episodes, 1.0)
    return out


def episode_stats(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """The step's figures: turns per episode (mean, max), tool calls, tool errors and tool seconds
    (totals), model and tool tokens, and episodes per end reason (`end_<reason>`)."""
    n = max(len(trajectories), 1)
    out = {
        "episodes": float(len(trajectories)),
        "turns_mean": sum(t.turns for t in trajectories) / n,
        "turns_max": float(max((t.turns for t in trajectories), default=0)),
        "tool_calls": float(sum(t.tool_calls for t in trajectories)),
        "tool_errors": float(sum(t.tool_errors for t in trajectories)),
        "tool_seconds": sum(t.tool_seconds for t in trajectories),
        "model_tokens": float(sum(t.model_tokens for t in trajectories)),
        "tool_tokens": float(sum(len(t.token_ids) - t.model_tokens for t in trajectories)),
    }
    for reason in END_REASONS:
        out[f"end_{reason}"] = float(sum(t.end_reason == reason for t in trajectories))
    return out
