"""Tools run off the event loop: a thread pool shared by a step's episodes, a timeout per call.

Owns turning a tool that raises or hangs into a `ToolFailure` with its reason, so the episode ends and the
step goes on. Must not know what tools compute. Python cannot stop a thread: a call past its timeout keeps
its thread until it returns; when every thread is held that way, new calls fail at once (tool_timeout)
instead of queueing forever. The timeout counts from submission: size the pool to the episodes that run at
once (the dispatcher does), so a call never waits for a thread behind live ones. A tool that must be killed (untrusted code) runs in a subprocess it starts
itself, with its own limits.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Callable
from typing import Any

from rlhf_trainer.agents.contract import ToolFailure


class ToolRunner:
    """`threads` threads for every episode's tool calls; each call may run `timeout` seconds."""

    def __init__(self, threads: int = 8, timeout: float = 30.0) -> None:
        if threads < 1 or timeout <= 0:
            raise ValueError(f"tool pool: threads {threads} and timeout {timeout} must be positive")
        self.threads = threads
        self.timeout = timeout
        self.executor = concurrent.futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tool")
        self._lock = threading.Lock()
        self.held = 0  # threads still running a call that timed out

    async def call(self, fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
        """(fn(*args), seconds it ran); raises ToolFailure: tool_error (it raised) or tool_timeout (it ran
        past the timeout, or no thread is free of an abandoned call)."""
        with self._lock:
            if self.held >= self.threads:
                raise ToolFailure(
                    "tool_timeout", f"all {self.threads} tool threads hold calls that timed out"
                )
        t0 = time.monotonic()
        future = self.executor.submit(self._run, fn, args)
        try:
            value = await asyncio.wait_for(asyncio.wrap_future(future), self.timeout)
        except TimeoutError:
            with self._lock:
                if not future.done():
                    self.held += 1
                    future.add_done_callback(self._released)
            raise ToolFailure("tool_timeout", f"{_name(fn)} ran past {self.timeout:g}s") from None
        except Exception as e:
            raise ToolFailure("tool_error", f"{_name(fn)} raised {type(e).__name__}: {e}") from e
        return value, time.monotonic() - t0

    @staticmethod
    def _run(fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        return fn(*args)

    def _released(self, _: concurrent.futures.Future[Any]) -> None:
        with self._lock:
            self.held -= 1

    def shutdown(self) -> None:
        """Stop taking calls; threads still running a hung tool are left to finish (never joined)."""
        self.executor.shutdown(wait=False, cancel_futures=True)


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__name__", type(fn).__name__)
