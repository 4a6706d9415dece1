"""The engine client over a real rollout engine: token-id requests batched into the engine's running vLLM
batch through `RolloutEngine.step_tokens`, each answered the moment it finishes.

Owns the per-engine pump: one `step_tokens` call in flight per engine (its actor runs one call at a time);
requests that arrive meanwhile join the next call, and each call returns as soon as any request finishes
or after a short slice, so a long generation never holds a short one back, nor a new one for long. Must not choose engines (agents.dispatch) nor know of
episodes. The call itself is injected (`StepCall`): a Ray actor's method, or a local engine in a thread.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from rlhf_trainer.agents.contract import EngineFailure, Generation, SamplingParams

# new requests (id, prompt_token_ids, sampling) -> {"finished": [(id, token_ids, logprobs, finish_reason)],
# "running": requests still in the engine} (RolloutEngine.step_tokens)
StepCall = Callable[[list[dict[str, Any]]], Awaitable[dict[str, Any]]]


class BatchingEngineClient:
    """An `EngineClient` for one engine; `name` labels its failures."""

    def __init__(self, step: StepCall, name: str = "engine") -> None:
        self.step = step
        self.name = name
        self._ids = itertools.count()
        self._queued: list[dict[str, Any]] = []
        self._waiting: dict[str, asyncio.Future[Generation]] = {}
        self._pump: asyncio.Task[None] | None = None

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generation:
        rid = str(next(self._ids))
        future: asyncio.Future[Generation] = asyncio.get_running_loop().create_future()
        self._waiting[rid] = future
        self._queued.append({"id": rid, "prompt_token_ids": list(prompt_ids), "sampling": params.wire()})
        if self._pump is None or self._pump.done():
            self._pump = asyncio.create_task(self._run())
        return await future

    async def _run(self) -> None:
        """Call the engine while any request is unanswered; a failed call fails every waiting request."""
        while self._waiting:
            batch, self._queued = self._queued, []
            try:
                answer = await self.step(batch)
            except Exception as e:
                self._fail(EngineFailure(f"{self.name}: {type(e).__name__}: {e}"))
                return
            finished: list[dict[str, Any]] = answer["finished"]
            for out in finished:
                future = self._waiting.pop(str(out["id"]))
                if not future.done():  # an episode cancelled meanwhile: its answer is dropped
                    future.set_result(
                        Generation(list(out["token_ids"]), list(out["logprobs"]), str(out["finish_reason"]))
                    )
            if int(answer["running"]) == 0 and self._waiting and not self._queued:
                # the engine holds none of the requests still waiting: they were lost
                self._fail(EngineFailure(f"{self.name}: {len(self._waiting)} request(s) lost by the engine"))
                return

    def _fail(self, failure: EngineFailure) -> None:
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(failure)
        self._waiting.clear()


def ray_engine_client(handle: Any, name: str) -> BatchingEngineClient:
    """A client over a RolloutEngine actor (a Ray ObjectRef is awaitable)."""

    async def step(batch: list[dict[str, Any]]) -> dict[str, Any]:
        result: dict[str, Any] = await handle.step_tokens.remote(batch)
        return result

    return BatchingEngineClient(step, name)


def local_engine_client(engine: Any, name: str = "engine") -> BatchingEngineClient:
    """A client over a RolloutEngine in this process (tests, tools): each call in a worker thread, so the
    event loop keeps running episodes while vLLM steps."""

    async def step(batch: list[dict[str, Any]]) -> dict[str, Any]:
        result: dict[str, Any] = await asyncio.to_thread(engine.step_tokens, batch)
        return result

    return BatchingEngineClient(step, name)
