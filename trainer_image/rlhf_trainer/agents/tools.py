"""Tools run off the event loop: a pool of `workers` threads shared by the episodes, a timeout per call.

Owns turning a tool that raises or hangs into a `ToolFailure` with its reason, so the episode ends and the
step goes on, and how many calls run now (`running`: what the `tool` phase shows). Must not know what tools
compute. A call waits for a free worker before its timeout starts, so it is never timed out behind live
ones. Python cannot stop a thread: a call past its timeout keeps its worker until it returns (`held`); when
every worker is held that way, new calls fail at once (tool_timeout) instead of queueing forever. A tool
that must be killed (untrusted code) runs in a subprocess it starts itself, with its own limits.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import time
from collections.abc import Callable
from typing import Any

from rlhf_trainer.agents.contract import ToolFailure


class ToolRunner:
    """`threads` workers for every episode's tool calls (rollout.agent.tool.workers); each call may run
    `timeout` seconds (tool.timeoutSeconds). Used from one event loop."""

    def __init__(self, threads: int = 8, timeout: float = 30.0) -> None:
        if threads < 1 or timeout <= 0:
            raise ValueError(f"tool pool: threads {threads} and timeout {timeout} must be positive")
        self.threads = threads
        self.timeout = timeout
        self.executor = concurrent.futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tool")
        self.running = 0  # workers running a call, live or past its timeout
        self.held = 0  # of them, running a call that timed out
        self._abandoned: set[concurrent.futures.Future[Any]] = set()
        self._freed: asyncio.Event | None = None

    async def call(self, fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
        """(fn(*args), seconds it ran); raises ToolFailure: tool_error (it raised) or tool_timeout (it ran
        past the timeout, or every worker holds a call that did)."""
        loop = asyncio.get_running_loop()
        freed = self._freed = self._freed or asyncio.Event()
        while self.running >= self.threads and self.held < self.threads:
            freed.clear()
            await freed.wait()
        if self.held >= self.threads:
            raise ToolFailure("tool_timeout", f"all {self.threads} tool workers hold calls that timed out")
        self.running += 1
        t0 = time.monotonic()
        future = self.executor.submit(fn, *args)

        def released(f: concurrent.futures.Future[Any]) -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody counts any more
                loop.call_soon_threadsafe(self._released, f)

        future.add_done_callback(released)
        try:
            value = await asyncio.wait_for(asyncio.wrap_future(future), self.timeout)
        except TimeoutError:
            if not future.done():
                self.held += 1
                self._abandoned.add(future)
            raise ToolFailure("tool_timeout", f"{_name(fn)} ran past {self.timeout:g}s") from None
        except Exception as e:
            raise ToolFailure("tool_error", f"{_name(fn)} raised {type(e).__name__}: {e}") from e
        return value, time.monotonic() - t0

    def _released(self, future: concurrent.futures.Future[Any]) -> None:
        """A worker finished its call (on the loop's thread): one more free, or one fewer held."""
        self.running -= 1
        if future in self._abandoned:
            self._abandoned.discard(future)
            self.held -= 1
        if self._freed is not None:
            self._freed.set()

    def shutdown(self) -> None:
        """Stop taking calls; threads still running a hung tool are left to finish (never joined)."""
        self.executor.shutdown(wait=False, cancel_futures=True)


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__name__", type(fn).__name__)
