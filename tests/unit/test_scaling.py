"""The engine autoscaler's policy: dead band, window, cooldown, range, and the history it keeps."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from rlhf_operator.scaling import (
    AT_MAX,
    CLAMPED,
    COOLDOWN,
    DISABLED,
    GENERATION_BOUND,
    INSIDE_BAND,
    NOT_ENOUGH_DATA,
    NOT_SUSTAINED,
    TRAINING_BOUND,
    append_history,
    clamp_request,
    decide_scale,
    history_from_status,
    history_to_status,
)
from rlhf_operator.spec import AutoscalingSpec

pytestmark = pytest.mark.unit

NOW = datetime(2026, 11, 23, 12, 0, tzinfo=UTC)
AS = AutoscalingSpec(
    enabled=True,
    minEngines=1,
    maxEngines=4,
    targetGenerationShare=0.55,
    hysteresis=0.1,
    windowSteps=3,
    cooldownSeconds=300,
)


def hist(*shares: float, first: int = 1) -> list[tuple[int, float]]:
    return [(first + i, s) for i, s in enumerate(shares)]


def test_generation_bound_adds_an_engine_with_the_numbers_in_the_message() -> None:
    d = decide_scale(hist(0.70, 0.72, 0.75), 2, AS, NOW, None)
    assert (d.target, d.direction, d.reason) == (3, "up", GENERATION_BOUND)
    assert d.message == "generation 70%-75% > 65% (target 55% + 10%) for 3 steps: engines 2→3"


def test_training_bound_removes_an_engine() -> None:
    d = decide_scale(hist(0.30, 0.20, 0.40), 3, AS, NOW, None)
    assert (d.target, d.direction, d.reason) == (2, "down", TRAINING_BOUND)


def test_inside_band_and_not_sustained_hold() -> None:
    assert decide_scale(hist(0.70, 0.72, 0.60), 2, AS, NOW, None).reason == INSIDE_BAND
    d = decide_scale(hist(0.70, 0.60, 0.72), 2, AS, NOW, None)
    assert (d.reason, d.changed) == (NOT_SUSTAINED, False)
    # A share exactly on the threshold is inside the band.
    assert decide_scale(hist(0.65, 0.65, 0.65), 2, AS, NOW, None).reason == INSIDE_BAND


def test_cooldown_and_window_since_the_last_change() -> None:
    d = decide_scale(hist(0.9, 0.9, 0.9), 2, AS, NOW, NOW - timedelta(seconds=100))
    assert (d.reason, d.target) == (COOLDOWN, 2)
    # After the cooldown, only steps that started after the change (step > 2 + 1) count.
    d = decide_scale(hist(0.9, 0.9, 0.9, 0.9), 2, AS, NOW, NOW - timedelta(seconds=400), last_scale_step=2)
    assert d.reason == NOT_ENOUGH_DATA and "1 of 3 steps" in d.message


def test_range_clamps_and_caps() -> None:
    assert decide_scale(hist(0.9, 0.9, 0.9), 4, AS, NOW, None).reason == AT_MAX
    d = decide_scale([], 9, AS, NOW, NOW)  # kubectl scale to 9: clamped even in cooldown
    assert (d.target, d.reason) == (4, CLAMPED)
    assert clamp_request(9, AS) == (
        4,
        "requested 9 engines, above rollout.autoscaling.maxEngines 4: running 4",
    )
    off = AutoscalingSpec(enabled=False)
    assert clamp_request(9, off) == (9, None)
    assert decide_scale(hist(0.9, 0.9, 0.9), 2, off, NOW, None).reason == DISABLED


def test_engines_per_step_moves_whole_workers() -> None:
    d = decide_scale(hist(0.9, 0.9, 0.9), 1, AS, NOW, None, engines_per_step=2)
    assert d.target == 3
    with pytest.raises(ValueError):
        decide_scale([], 1, AS, NOW, None, engines_per_step=0)


def test_history_is_one_entry_per_step_and_a_rerun_drops_later_steps() -> None:
    h = append_history([], 1, 0.5, keep=3)
    h = append_history(h, 2, 0.6, keep=3)
    h = append_history(h, 3, 0.7, keep=3)
    h = append_history(h, 4, 0.8, keep=3)
    assert h == [(2, 0.6), (3, 0.7), (4, 0.8)]
    # A restart from the step-2 checkpoint re-runs step 3: the old 3 and 4 belonged to the last attempt.
    assert append_history(h, 3, 0.1, keep=3) == [(2, 0.6), (3, 0.1)]
    assert append_history(h, 0, 0.5, keep=3) == h
    assert append_history(h, 5, float("nan"), keep=3) == h
    assert history_from_status(history_to_status(h)) == h
