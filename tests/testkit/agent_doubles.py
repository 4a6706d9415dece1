"""Test doubles for agentic rollout (rlhf_trainer.agents): an engine client whose replies and latency a
test scripts, and a one-character-per-token codec. They stand in for vLLM and a tokenizer in the unit
tests; the real engine is exercised in tests/e2e/ray/test_agent_tokens.py."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from rlhf_trainer.agents.contract import Generation, SamplingParams

# (prompt ids, params) -> (reply token ids, seconds the reply takes)
Script = Callable[[Sequence[int], SamplingParams], tuple[list[int], float]]


class CharCodec:
    """One token per character (its code point): the tests' tokenizer."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(chr(i) for i in ids)


@dataclass
class ScriptedEngineClient:
    """A TEST DOUBLE of an EngineClient: replies per `script` after its delay; records every call and the
    most requests it ever had in flight at once. Log-prob of reply token k is -(k + 1) / 100."""

    script: Script
    name: str = "double"
    calls: list[tuple[list[int], SamplingParams]] = field(default_factory=list)
    in_flight: int = 0
    peak: int = 0

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generation:
        self.calls.append((list(prompt_ids), params))
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            ids, delay = self.script(prompt_ids, params)
            await asyncio.sleep(delay)
        finally:
            self.in_flight -= 1
        ids = ids[: params.max_tokens]
        finish = "length" if len(ids) == params.max_tokens else "stop"
        return Generation(ids, [-(k + 1) / 100 for k in range(len(ids))], finish)


def text_reply(text: str, delay: float = 0.0) -> Script:
    """A script that always answers `text` (CharCodec ids) after `delay` seconds."""
    return lambda _ids, _params: ([ord(c) for c in text], delay)
