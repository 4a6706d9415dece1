"""throttle.RemoteLimiter caps the operator's calls to Ray heads; first_delay spreads the timers' rounds."""

from __future__ import annotations

import random
import threading
import time

import pytest
from rlhf_operator.throttle import RemoteLimiter, first_delay

pytestmark = pytest.mark.unit


def _peak(limiter: RemoteLimiter, urls: list[str]) -> tuple[int, dict[str, int]]:
    """Run one 20 ms call per url, all at once; return the peak in flight overall and per host."""
    lock = threading.Lock()
    now: dict[str, int] = {}
    peak_host: dict[str, int] = {}
    peak = [0, 0]

    def call(url: str) -> None:
        host = url.split("/")[2]
        with limiter.slot(url):
            with lock:
                now[host] = now.get(host, 0) + 1
                peak[0] += 1
                peak[1] = max(peak[1], peak[0])
                peak_host[host] = max(peak_host.get(host, 0), now[host])
            time.sleep(0.02)
            with lock:
                now[host] -= 1
                peak[0] -= 1

    threads = [threading.Thread(target=call, args=(u,)) for u in urls]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return peak[1], peak_host


def test_calls_are_capped_in_total_and_per_host() -> None:
    urls = [f"http://head-{i % 5}:8265/api/jobs/x" for i in range(40)]
    total, per_host = _peak(RemoteLimiter(total=4, per_host=2), urls)
    assert total == 4, total  # 40 threads, 5 hosts: the total cap binds
    assert max(per_host.values()) == 2, per_host
    one_host = [f"http://head-0:8265/metrics?{i}" for i in range(20)]
    total, per_host = _peak(RemoteLimiter(total=8, per_host=3), one_host)
    assert total == 3 and per_host == {"head-0:8265": 3}, (total, per_host)  # the host cap binds


def test_limits_below_one_are_refused() -> None:
    with pytest.raises(ValueError, match="per_host=0"):
        RemoteLimiter(total=4, per_host=0)


def test_first_delays_spread_over_one_interval() -> None:
    rng = random.Random(7)
    delays = [first_delay(30.0, rng) for _ in range(1000)]
    assert min(delays) >= 0.2 and max(delays) <= 30.0
    # spread, not bunched: each tenth of the interval gets some of 1,000 timers
    buckets = {int(d // 3.0) for d in delays}
    assert buckets == set(range(10)), sorted(buckets)
