"""The default agent: one model turn from the prompt, today's rollout, so a job without rollout.agent
trains on exactly what it trained on before.

Must not call tools or append anything: its trajectory is the prompt and one sampled response, every
response token a model token (loss mask all 1).
"""

from __future__ import annotations

from rlhf_trainer.agents.contract import Episode, Trajectory

DEFAULT_AGENT = "rlhf_trainer.agents.default:single_turn"


async def single_turn(episode: Episode) -> Trajectory:
    """One generation of up to the token budget (algorithm.maxResponseLength); the reward is left to the
    job's reward function, as today."""
    await episode.generate()
    return episode.finish()
