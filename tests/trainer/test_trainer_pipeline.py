"""Asynchronous RL's pure decisions (trainer_image/rlhf_trainer/pipeline.py): staleness, admission of a
batch, the idle ratios, and the background thread that drains a batch generated ahead."""

from __future__ import annotations

import threading
import time

import pytest
from rlhf_trainer.pipeline import Background, admit, busy_seconds, idle_ratio, staleness

pytestmark = pytest.mark.unit


def test_staleness_counts_optimizer_steps_between_generating_and_trained_weights() -> None:
    assert staleness(5, 4) == 1  # generated during the last step, with the weights before it
    assert staleness(5, 5) == 0  # generated with the weights being trained (the synchronous case)
    assert staleness(7, 4) == 3
    assert staleness(0, 0) == 0


@pytest.mark.parametrize("policy", ["Regenerate", "Drop"])
def test_a_batch_within_the_bound_is_trained_and_one_beyond_follows_stale_samples(policy: str) -> None:
    assert admit(0, 1, policy) == "train"
    assert admit(1, 1, policy) == "train"
    assert admit(2, 1, policy) == policy
    assert admit(4, 4, policy) == "train"
    assert admit(5, 4, policy) == policy


def test_an_unknown_stale_samples_policy_is_an_error_not_a_silent_train() -> None:
    with pytest.raises(ValueError, match="staleSamples"):
        admit(2, 1, "Keep")


def test_busy_seconds_clips_to_the_step_and_counts_overlaps_once() -> None:
    assert busy_seconds([(0.0, 4.0)], 1.0, 3.0) == pytest.approx(2.0)
    assert busy_seconds([(0.0, 2.0), (1.0, 3.0)], 0.0, 10.0) == pytest.approx(3.0)  # overlap counted once
    assert busy_seconds([(5.0, 6.0), (0.0, 1.0)], 0.0, 10.0) == pytest.approx(2.0)  # any order
    assert busy_seconds([(11.0, 12.0)], 0.0, 10.0) == 0.0
    assert busy_seconds([], 0.0, 10.0) == 0.0


def test_idle_ratio_is_the_share_of_the_step_not_busy() -> None:
    assert idle_ratio(3.0, 10.0) == pytest.approx(0.7)
    assert idle_ratio(10.0, 10.0) == 0.0
    assert idle_ratio(12.0, 10.0) == 0.0  # clock noise never makes it negative
    assert idle_ratio(0.0, 10.0) == 1.0
    assert idle_ratio(1.0, 0.0) == 0.0


def test_background_runs_at_once_and_result_waits_for_it() -> None:
    gate = threading.Event()
    ran = threading.Event()

    def work() -> int:
        ran.set()
        gate.wait(5)
        return 42

    job = Background(work)
    assert ran.wait(5), "the work must start without anyone asking for its result"
    assert not job.done()
    start, end = job.interval(now=job.started + 1.0)
    assert end - start == pytest.approx(1.0)  # still running: up to now
    gate.set()
    assert job.result(timeout=5) == 42
    assert job.done() and job.finished is not None and job.finished >= job.started


def test_background_hands_its_error_to_the_caller() -> None:
    def work() -> int:
        raise RuntimeError("every rollout engine was lost")

    job = Background(work)
    with pytest.raises(RuntimeError, match="every rollout engine was lost"):
        job.result(timeout=5)


def test_background_result_times_out_rather_than_hanging() -> None:
    gate = threading.Event()
    job = Background(lambda: gate.wait(10))
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        job.result(timeout=0.2)
    assert time.monotonic() - t0 < 2
    gate.set()
