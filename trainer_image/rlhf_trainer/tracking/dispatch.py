"""One tracking sink behind a bounded queue and its own thread, so a backend that is slow or down never
holds up a step: the step only enqueues (never blocks), the thread delivers in order, retrying each event
with capped exponential backoff, and counts every failed call and every dropped event.

Owns the delivery policy only; knows no backend (a `Sink`) and no Prometheus (an `Observer`).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

Kind = Literal["params", "metrics", "samples"]
# The columns of a samples table, in this order, in every sink.
SAMPLE_COLUMNS = ("step", "prompt", "completion", "reward")


@dataclass(frozen=True)
class Event:
    """What a sink is given: the config once (params), a step's metrics, or a step's samples table."""

    kind: Kind
    step: int
    payload: Any  # params: dict[str, str]; metrics: dict[str, float]; samples: list[SampleRow]


@dataclass(frozen=True)
class SampleRow:
    prompt: str
    completion: str
    reward: float | None  # None: the reward failed for this sample (counted in rlhf_reward_errors_total)


class Sink(Protocol):
    """A tracking backend. Every method may raise; the dispatcher retries and counts."""

    name: str

    def open(self) -> str:
        """Start (or resume) the run; returns where it is (a URL or a directory)."""
        ...

    def log_params(self, params: dict[str, str]) -> None: ...

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None: ...

    def log_samples(self, step: int, rows: list[SampleRow]) -> None: ...

    def close(self) -> None: ...


class Observer(Protocol):
    """Where the dispatcher reports (the trainer's exporter: rlhf_tracking_* series)."""

    def tracking_started(self, sink: str, url: str) -> None: ...

    def tracking_failed(self, sink: str, error: str) -> None: ...

    def tracking_succeeded(self, sink: str) -> None: ...

    def tracking_dropped(self, sink: str, events: int) -> None: ...


@dataclass(frozen=True)
class RetryPolicy:
    """Capped exponential backoff: attempt k (from 1) waits base * 2**(k-1), at most `cap` seconds. By
    default (`attempts` None) an event is retried until it is delivered: an outage loses nothing while
    the bounded queue has room (new events are dropped, counted, only when it is full; the real node's run
    lost a step to an outage of about a minute when an event was given up after 8 attempts, ~45 s). With
    `attempts`, an event that failed that many times is dropped (counted) and the next one is tried."""

    attempts: int | None = None
    base_seconds: float = 0.5
    cap_seconds: float = 15.0

    def delay(self, failed: int) -> float:
        """Seconds to wait after the `failed`-th failed attempt of one event."""
        return float(min(self.cap_seconds, self.base_seconds * 2 ** max(0, failed - 1)))


def short_error(e: BaseException, limit: int = 200) -> str:
    """An exception as one short line (a Prometheus label value and a condition message)."""
    text = " ".join(f"{type(e).__name__}: {e}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass
class SinkDispatcher:
    """Delivers `Event`s to one `Sink` from a background thread; `submit` never blocks."""

    sink: Sink
    observer: Observer
    capacity: int = 256
    policy: RetryPolicy = field(default_factory=RetryPolicy)
    sleep: Callable[[float], object] | None = None  # None: wait on the stop flag (close interrupts it)
    opened: bool = False
    delivered: int = 0
    failures: int = 0
    dropped: int = 0
    last_error: str = ""

    def __post_init__(self) -> None:
        self._queue: queue.Queue[Event | None] = queue.Queue(maxsize=self.capacity)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"tracking-{self.sink.name}", daemon=True)

    def start(self) -> SinkDispatcher:
        self._thread.start()
        return self

    def submit(self, event: Event) -> bool:
        """Queue `event` for delivery; False (and counted as dropped) when the queue is full."""
        try:
            self._queue.put_nowait(event)
            return True
        except queue.Full:
            self._drop(1)
            return False

    def pending(self) -> int:
        return self._queue.qsize()

    def close(self, timeout: float) -> None:
        """Deliver what is queued within `timeout` seconds, then stop; what is left is counted as dropped."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.05)
        self._stop.set()
        with contextlib.suppress(queue.Full):  # wake the thread (a full queue wakes it anyway)
            self._queue.put_nowait(None)
        self._thread.join(max(0.0, deadline - time.monotonic()) + 0.5)
        left = sum(1 for e in self._drain() if e is not None)
        if left:
            self._drop(left)
        if self.opened:
            try:
                self.sink.close()
            except Exception as e:
                self._failed(e)

    def _drain(self) -> list[Event | None]:
        out: list[Event | None] = []
        while True:
            try:
                out.append(self._queue.get_nowait())
            except queue.Empty:
                return out

    def _run(self) -> None:
        while not self._stop.is_set():
            event = self._queue.get()
            try:
                if event is None:
                    return
                self._deliver(event)
            finally:
                self._queue.task_done()

    def _deliver(self, event: Event) -> None:
        """Open the run if needed, then the event, each try retried with backoff until it is delivered (or
        dropped after the policy's last attempt, or when the dispatcher stops)."""
        limit = self.policy.attempts
        attempt = 0
        while limit is None or attempt < limit:
            attempt += 1
            if self._stop.is_set():
                self._drop(1)
                return
            try:
                if not self.opened:
                    url = self.sink.open()
                    self.opened = True
                    self.observer.tracking_started(self.sink.name, url)
                self._call(event)
            except Exception as e:
                self._failed(e)
                if self._permanent(e):  # the backend refused this event: no retry can change that
                    break
                if limit is None or attempt < limit:
                    self._pause(self.policy.delay(attempt))
                continue
            self.delivered += 1
            self.observer.tracking_succeeded(self.sink.name)
            return
        self._drop(1)

    def _permanent(self, e: BaseException) -> bool:
        """Whether the sink says `e` is the backend refusing the event itself (a 4xx answer), not being
        unreachable: retrying it would hold every later event behind it (a sink may define `permanent`)."""
        permanent = getattr(self.sink, "permanent", None)
        return bool(permanent(e)) if callable(permanent) else False

    def _pause(self, seconds: float) -> None:
        if self.sleep is not None:
            self.sleep(seconds)
        else:
            self._stop.wait(seconds)

    def _call(self, event: Event) -> None:
        if event.kind == "params":
            self.sink.log_params(event.payload)
        elif event.kind == "metrics":
            self.sink.log_metrics(event.step, event.payload)
        else:
            self.sink.log_samples(event.step, event.payload)

    def _failed(self, e: BaseException) -> None:
        self.failures += 1
        self.last_error = short_error(e)
        self.observer.tracking_failed(self.sink.name, self.last_error)

    def _drop(self, events: int) -> None:
        self.dropped += events
        self.observer.tracking_dropped(self.sink.name, events)
