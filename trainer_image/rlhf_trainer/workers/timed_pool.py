"""A thread pool whose calls time out counted from their start, not from their submission.

Owns the reward scorer's threads: sub-batches legitimately queue behind each other, and a limit counted
from submission would turn that wait into reward errors. Must not know what the calls compute.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable
from typing import Any


class CallTimeout(Exception):
    """A call ran past its limit, or could not start because every thread holds one that did."""


class TimedCall:
    """One submitted call: `result()` waits for it to start, then at most `timeout` seconds more."""

    def __init__(self, pool: TimedPool, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.pool = pool
        self.started = threading.Event()
        self.start_time = 0.0
        self.done = False
        self.abandoned = False  # timed out while still running: it holds a thread until it returns
        self.future = pool.executor.submit(self._run, fn, args)

    def _run(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        self.start_time = time.monotonic()
        self.started.set()
        try:
            return fn(*args)
        finally:
            with self.pool.lock:
                self.done = True
                if self.abandoned:
                    self.pool.abandoned -= 1

    def result(self) -> Any:
        """The call's return value; raises what it raised, or CallTimeout."""
        pool = self.pool
        while not self.started.wait(pool.poll_seconds):
            with pool.lock:
                jammed = pool.abandoned >= pool.threads
            if jammed and self.future.cancel():  # Python cannot stop a thread: it would wait forever
                raise CallTimeout(f"not started: all {pool.threads} threads still run calls that timed out")
        left = pool.timeout - (time.monotonic() - self.start_time)
        try:
            return self.future.result(timeout=max(left, 0.0))
        except concurrent.futures.TimeoutError:
            with pool.lock:
                if not self.done:
                    self.abandoned = True
                    pool.abandoned += 1
            raise CallTimeout(f"timed out after {pool.timeout}s") from None


class TimedPool:
    """`threads` threads; `submit(fn, *args).result()` allows each call `timeout` seconds of running."""

    def __init__(self, threads: int, timeout: float, poll_seconds: float = 1.0) -> None:
        self.threads = threads
        self.timeout = timeout
        self.poll_seconds = poll_seconds  # how often a queued call checks whether the pool is jammed
        self.executor = concurrent.futures.ThreadPoolExecutor(max_workers=threads)
        self.lock = threading.Lock()
        self.abandoned = 0  # calls past their limit that still hold a thread

    def submit(self, fn: Callable[..., Any], *args: Any) -> TimedCall:
        return TimedCall(self, fn, args)
