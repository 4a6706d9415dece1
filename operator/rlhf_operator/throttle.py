"""Limits on the operator's calls to Ray heads (Jobs API, trainer /metrics), and jitter for its rounds.

With 1,000 jobs a reconcile round fires about every interval / 1,000 seconds. Without a limit, a burst of
rounds (after a watch reconnect or an operator restart) opens as many connections to the heads as kopf
has handler threads, and timers started together stay in step. So every remote call takes a slot: at
most `total` in flight, and at most `per_host` to one host, so one slow head cannot hold every slot.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import urlsplit


class RemoteLimiter:
    """At most `total` calls at once, and at most `per_host` of them to one host."""

    def __init__(self, total: int, per_host: int) -> None:
        if total < 1 or per_host < 1:
            raise ValueError(f"limits must be at least 1 (total={total}, per_host={per_host})")
        self.total, self.per_host = total, per_host
        self._all = threading.BoundedSemaphore(total)
        self._hosts: dict[str, threading.BoundedSemaphore] = {}
        self._lock = threading.Lock()

    def _host(self, url: str) -> threading.BoundedSemaphore:
        host = urlsplit(url).netloc
        with self._lock:
            sem = self._hosts.get(host)
            if sem is None:
                sem = self._hosts[host] = threading.BoundedSemaphore(self.per_host)
            return sem

    def forget(self, url: str) -> None:
        """Drop a host's slot (its RayCluster is gone), so the table does not grow with every job ever run."""
        with self._lock:
            self._hosts.pop(urlsplit(url).netloc, None)

    @contextmanager
    def slot(self, url: str) -> Iterator[None]:
        host = self._host(url)
        with host, self._all:
            yield


def first_delay(interval: float, rng: random.Random | None = None) -> float:
    """A timer's first delay: spread over one interval, so rounds of jobs created together do not fire
    together for ever after (kopf's timers keep the phase of their first fire)."""
    return (rng or random).uniform(min(0.2, interval), interval)
