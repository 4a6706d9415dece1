"""The tiny agent task (the trainer stage's agentic run): calling the tool is the only way to a high reward.

The model "calls" the oracle tool by writing a word of vowels alone (one of the tiny BPE vocabulary's
tokens `a`, `e`, ..., `ou`, `ea`) in its first turn: the untrained tiny model does that in about 15-20 % of
its turns. The oracle's answer, a phrase of the tiny language the model never writes by itself, is appended
as tool tokens (loss mask 0), and the model takes a second turn. The reward (`reward`) is 1.0 when the
response holds the answer, else 0.0: only a tool call earns it, and the policy learns to call it. Test-only:
loaded by the trainer as `path/to/agent_task.py:agent` and `:reward`.
"""

from __future__ import annotations

from collections.abc import Sequence

from rlhf_trainer.agents.contract import Episode, TextCodec, Trajectory

VOWELS = frozenset("aeiou")
ANSWER = "lumo kaidrest"  # what the oracle says: made of the tiny language's syllables, so it encodes
FIRST_TURN_TOKENS = 8
SECOND_TURN_TOKENS = 4


def calls_tool(token_ids: Sequence[int], codec: TextCodec) -> bool:
    """Whether a turn holds a token that is a word of vowels alone: the task's tool call."""
    for t in token_ids:
        word = codec.decode([t]).strip()
        if word and set(word) <= VOWELS:
            return True
    return False


def oracle() -> str:
    return ANSWER


async def agent(episode: Episode) -> Trajectory:
    turn = await episode.generate(max_tokens=FIRST_TURN_TOKENS)
    if not calls_tool(turn.token_ids, episode.codec):
        return episode.finish()
    answer = await episode.call_tool(oracle)
    episode.append_text(f" {answer} ")
    await episode.generate(max_tokens=SECOND_TURN_TOKENS)
    return episode.finish()


def reward(prompts: list[str], responses: list[str]) -> list[float]:
    del prompts
    return [1.0 if ANSWER in r else 0.0 for r in responses]
