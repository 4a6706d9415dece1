"""The agent runner: the Ray actor (async) that runs a step's agent episodes (rollout.agent) over the rollout
engines and streams the chunks back to the driver's chunk dispatcher, as an engine streams its own.

Owns the process-level state of agentic rollout: the user's agent function, loaded once; the actor's
tokenizer as the agents' text codec; one tool pool for the whole run (a worker held by a hung tool stays
held across steps); one batching client per engine. Must not decide what a step does: the work is
`agents.chunks.stream_chunks`, and each engine call is one `RolloutEngine.step_tokens` (thin: token ids of
new requests out, finished ones back).
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from rlhf_trainer.agents.chunks import AgentSettings, Item, stream_chunks
from rlhf_trainer.agents.contract import Limits, SamplingParams, load_agent_function
from rlhf_trainer.agents.engine_client import BatchingEngineClient, ray_engine_client
from rlhf_trainer.agents.tools import ToolRunner
from rlhf_trainer.data import Prompt
from rlhf_trainer.rollout.engine import encode_prompt, sampling_seed
from rlhf_trainer.stacks import dump as stacks


class TokenizerCodec:
    """The actor tokenizer as an agent's TextCodec: text a tool adds is encoded without special tokens,
    and token ids decode as vLLM detokenizes a response (special tokens skipped)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))


class AgentRunner:
    """Instantiated as an async Ray actor by placement when rollout.agent is set (config.agent_options)."""

    def __init__(self, options: dict[str, Any]) -> None:
        from transformers import AutoTokenizer

        stacks.arm("agent runner", "agent")
        self.options = options
        self.agent = load_agent_function(str(options["function"]))
        self.tokenizer = AutoTokenizer.from_pretrained(options["tokenizer_path"])
        self.codec = TokenizerCodec(self.tokenizer)
        self.settings = AgentSettings(
            limits=Limits(int(options["max_turns"]), int(options["max_tokens"])),
            per_engine=int(options["max_episodes_per_engine"]),
            input_key=str(options["input_key"]),
            label_key=options.get("label_key"),
            seed=int(options.get("seed", 0)),
        )
        self.tools = ToolRunner(int(options["tool_workers"]), float(options["tool_timeout_seconds"]))
        self.clients: dict[int, tuple[Any, BatchingEngineClient]] = {}  # engine index -> (handle, client)

    async def ready(self) -> dict[str, Any]:
        return {"pid": os.getpid()}

    def _client(self, index: int, handle: Any) -> BatchingEngineClient:
        """One client per engine, kept while the engine is (a replaced engine gets a new index)."""
        known = self.clients.get(index)
        if known is None or known[0] != handle:
            known = (handle, ray_engine_client(handle, f"rollout engine {index}"))
            self.clients[index] = known
        return known[1]

    async def generate_chunks(
        self, chunks: list[dict[str, Any]], sampling: dict[str, Any], engines: list[tuple[int, Any]]
    ) -> AsyncIterator[Item]:
        """Ray streaming generator over every chunk of the step (agents.chunks.stream_chunks), the episodes
        dispatched per request over `engines` ((engine index, RolloutEngine handle)). `sampling`: the
        step's (config.sampling or eval_sampling, with `step`)."""
        max_prompt = int(sampling.get("max_prompt_tokens", 0)) or None
        chat = bool(self.options.get("chat_template"))
        step = int(sampling.get("step", 0))

        def encode(prompt: Prompt) -> list[int]:
            return encode_prompt(self.tokenizer, prompt, chat, max_prompt)

        def seed_of(group: int) -> int | None:
            return sampling_seed(self.settings.seed, step, group)

        params = SamplingParams(
            max_tokens=self.settings.limits.max_tokens,
            temperature=float(sampling.get("temperature", 1.0)),
            top_p=float(sampling.get("top_p", 1.0)),
        )
        clients = [(index, self._client(index, handle)) for index, handle in engines]
        async for item in stream_chunks(
            self.agent, chunks, clients, n=int(sampling["n"]), sampling=params, settings=self.settings,
            codec=self.codec, tools=self.tools, encode=encode, seed_of=seed_of, clock=time.perf_counter,
        ):  # fmt: skip
            yield item
