"""The reward scorer's thread pool (rlhf_trainer.workers.timed_pool): a call's limit counts from its
start, so queueing behind other calls is no error, and a pool jammed by timed-out calls fails fast."""

from __future__ import annotations

import threading
import time

import pytest
from rlhf_trainer.workers.timed_pool import CallTimeout, TimedPool

pytestmark = pytest.mark.unit


def test_calls_queued_behind_others_are_not_timed_out_by_the_wait() -> None:
    """Four callers wait at once on one thread (as the scorer's sub-batches do): the last starts about
    0.45 s after it was submitted, past the 0.3 s limit, and still runs to its end."""
    pool = TimedPool(threads=1, timeout=0.3, poll_seconds=0.01)
    results: list[object] = []

    def caller() -> None:
        try:
            results.append(pool.submit(time.sleep, 0.15).result())
        except CallTimeout as e:
            results.append(e)

    callers = [threading.Thread(target=caller) for _ in range(4)]
    for c in callers:
        c.start()
    for c in callers:
        c.join()
    assert results == [None] * 4


def test_a_call_running_past_its_limit_times_out_and_errors_pass_through() -> None:
    pool = TimedPool(threads=2, timeout=0.1, poll_seconds=0.01)
    with pytest.raises(CallTimeout, match=r"timed out after 0\.1s"):
        pool.submit(time.sleep, 0.5).result()

    def boom() -> None:
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        pool.submit(boom).result()
    assert pool.submit(lambda: 7).result() == 7


def test_a_pool_whose_threads_all_hold_timed_out_calls_refuses_new_ones_until_one_returns() -> None:
    release = threading.Event()
    pool = TimedPool(threads=1, timeout=0.05, poll_seconds=0.01)
    with pytest.raises(CallTimeout, match="timed out"):
        pool.submit(release.wait).result()  # hangs: it keeps the only thread
    t0 = time.monotonic()
    with pytest.raises(CallTimeout, match="not started: all 1 threads"):
        pool.submit(lambda: 1).result()
    assert time.monotonic() - t0 < 1.0  # not a wait for the hung call
    release.set()
    deadline = time.monotonic() + 5
    while pool.abandoned and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pool.abandoned == 0
    assert pool.submit(lambda: 2).result() == 2
