"""The engine autoscaler's policy: dead band, window, cooldown, range, and the history it keeps."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from rlhf_api.spec import AutoscalingSpec, RLHFJobSpec
from rlhf_operator.scaling import (
    AT_MAX,
    AT_MIN,
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
    plan_engines,
)

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]

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


# ---------------------------------------------------------------------------- the policy as a table

LATER = NOW - timedelta(seconds=400)  # a last change outside the 300 s cooldown
RECENT = NOW - timedelta(seconds=100)  # inside it


@pytest.mark.parametrize(
    ("case", "history", "engines", "last_time", "last_step", "expected"),
    [
        (
            "up: above the band for the window",
            hist(0.8, 0.8, 0.8),
            2,
            None,
            None,
            (3, "up", GENERATION_BOUND),
        ),
        (
            "down: below the band for the window",
            hist(0.2, 0.3, 0.2),
            2,
            None,
            None,
            (1, "down", TRAINING_BOUND),
        ),
        ("hold: latest inside the band", hist(0.8, 0.8, 0.6), 2, None, None, (2, "hold", INSIDE_BAND)),
        ("hold: inside the band, low side", hist(0.2, 0.2, 0.5), 2, None, None, (2, "hold", INSIDE_BAND)),
        (
            "hold: out of band but not sustained",
            hist(0.8, 0.5, 0.8),
            2,
            None,
            None,
            (2, "hold", NOT_SUSTAINED),
        ),
        ("hold: above then below", hist(0.8, 0.8, 0.2), 2, None, None, (2, "hold", NOT_SUSTAINED)),
        ("cooldown holds a clear up", hist(0.9, 0.9, 0.9), 2, RECENT, None, (2, "hold", COOLDOWN)),
        ("after the cooldown it acts", hist(0.9, 0.9, 0.9), 2, LATER, None, (3, "up", GENERATION_BOUND)),
        (
            "only steps that started after the change count",
            hist(0.9, 0.9, 0.9, 0.9, 0.9, 0.9),
            2,
            LATER,
            2,
            (3, "up", GENERATION_BOUND),
        ),
        ("at max: no more engines", hist(0.9, 0.9, 0.9), 4, None, None, (4, "hold", AT_MAX)),
        ("at min: no fewer engines", hist(0.1, 0.1, 0.1), 1, None, None, (1, "hold", AT_MIN)),
        ("clamp above max, even in cooldown", hist(0.5), 7, RECENT, None, (4, "down", CLAMPED)),
        ("clamp below min", [], 0, None, None, (1, "up", CLAMPED)),
        ("missing data: no steps", [], 2, None, None, (2, "hold", NOT_ENOUGH_DATA)),
        ("missing data: fewer than the window", hist(0.9, 0.9), 2, None, None, (2, "hold", NOT_ENOUGH_DATA)),
        (
            "missing data: non-numbers are not steps",
            [(1, 0.9), (2, float("nan")), (3, 0.9)],
            2,
            None,
            None,
            (2, "hold", NOT_ENOUGH_DATA),
        ),
    ],
)
def test_policy_table(
    case: str,
    history: list[tuple[int, float]],
    engines: int,
    last_time: datetime | None,
    last_step: int | None,
    expected: tuple[int, str, str],
) -> None:
    d = decide_scale(history, engines, AS, NOW, last_time, last_step)
    assert (d.target, d.direction, d.reason) == expected, f"{case}: {d.message}"
    moved = f"engines {engines}→{d.target}" if d.changed else f"engines stay {engines}"
    assert d.message.endswith(moved) or d.reason == CLAMPED, d.message


def test_down_message_has_the_numbers() -> None:
    d = decide_scale(hist(0.30, 0.20, 0.40), 3, AS, NOW, None)
    assert d.message == "generation 20%-40% < 45% (target 55% - 10%) for 3 steps: engines 3→2"


# ------------------------------------------------------------------- one reconcile's plan (plan_engines)


def spec(engines: int = 2, **autoscaling: Any) -> RLHFJobSpec:
    doc = yaml.safe_load((ROOT / "examples" / "rlhfjob-tiny.yaml").read_text())["spec"]
    scaling = {
        "enabled": True,
        "minEngines": 1,
        "maxEngines": 4,
        "targetGenerationShare": 0.55,
        "hysteresis": 0.1,
        "windowSteps": 3,
        "cooldownSeconds": 300,
    }
    scaling.update(autoscaling)
    doc["rollout"] = {"engines": engines, "autoscaling": scaling}
    return RLHFJobSpec.model_validate(doc)


def running(
    step: int, share: float | None, engines: int = 2, history: list[Any] | None = None
) -> dict[str, Any]:
    st: dict[str, Any] = {"phase": "Running", "step": step, "rollout": {"desiredEngines": engines}}
    if share is not None:
        st["generationShare"] = share
    if history is not None:
        st["rollout"]["generationShareHistory"] = history_to_status(history)
    return st


def test_plan_scales_up_and_records_the_change() -> None:
    prev = running(3, 0.8, history=hist(0.8, 0.8))
    plan = plan_engines(spec(), prev, running(3, 0.8, history=hist(0.8, 0.8)) | {"step": 4}, NOW)
    assert (plan.engines, plan.write_spec, plan.direction) == (3, True, "up")
    assert plan.events == [
        ("Normal", GENERATION_BOUND, "generation 80% > 65% (target 55% + 10%) for 3 steps: engines 2→3")
    ]
    assert plan.status["lastScaleTime"] == "2026-11-23T12:00:00Z"
    assert plan.status["lastScaleStep"] == 4
    assert plan.status["rollout"]["desiredEngines"] == 3
    assert history_from_status(plan.status["rollout"]["generationShareHistory"]) == [
        (1, 0.8),
        (2, 0.8),
        (4, 0.8),
    ]


def test_plan_holds_without_writing_and_keeps_the_window_bounded() -> None:
    prev = running(5, 0.6, history=hist(0.6, 0.6, 0.6, first=3))
    plan = plan_engines(spec(), prev, running(6, 0.6, history=hist(0.6, 0.6, 0.6, first=3)), NOW)
    assert (plan.engines, plan.write_spec, plan.events, plan.direction) == (2, False, [], None)
    assert plan.decision is not None and plan.decision.reason == INSIDE_BAND
    assert "lastScaleTime" not in plan.status
    assert [s for s, _ in history_from_status(plan.status["rollout"]["generationShareHistory"])] == [4, 5, 6]


def test_plan_policy_waits_while_not_running_or_without_a_share() -> None:
    for status in ({**running(4, 0.9, history=hist(0.9, 0.9, 0.9)), "phase": "Stalled"}, running(0, None)):
        plan = plan_engines(spec(), status, status, NOW)
        assert (plan.engines, plan.write_spec, plan.events) == (2, False, [])


def test_plan_clamps_an_out_of_range_request_with_a_warning() -> None:
    prev = running(4, 0.5, engines=2)
    plan = plan_engines(spec(engines=9), prev, prev, NOW - timedelta(seconds=1))
    assert (plan.engines, plan.requested, plan.write_spec, plan.direction) == (4, 9, True, "down")
    assert plan.events == [
        (
            "Warning",
            CLAMPED,
            "requested 9 engines, above rollout.autoscaling.maxEngines 4: running 4 (engines 2→4)",
        )
    ]
    assert plan.status["lastScaleStep"] == 4


def test_plan_reports_a_request_made_elsewhere_and_restarts_the_cooldown() -> None:
    prev = running(7, 0.5, engines=1)
    plan = plan_engines(spec(engines=2), prev, prev, NOW)
    assert (plan.engines, plan.write_spec) == (2, False)
    assert plan.events == [("Normal", "EnginesScaled", "spec.rollout.engines 1→2: rollout workers 1→2")]
    assert (plan.status["lastScaleTime"], plan.status["lastScaleStep"]) == ("2026-11-23T12:00:00Z", 7)


def test_plan_without_autoscaling_runs_any_request_and_keeps_no_history() -> None:
    prev = running(3, 0.9, engines=2, history=hist(0.9, 0.9, 0.9))
    plan = plan_engines(spec(engines=9, enabled=False), prev, prev, NOW)
    assert (plan.engines, plan.write_spec) == (9, False)
    assert "generationShareHistory" not in plan.status["rollout"]
    assert [reason for _, reason, _ in plan.events] == ["EnginesScaled"]


def pod(name: str, phase: str = "Running", unschedulable: str | None = None) -> dict[str, Any]:
    conds = []
    if unschedulable is not None:
        conds.append(
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": unschedulable}
        )
    return {"metadata": {"name": name}, "status": {"phase": phase, "conditions": conds}}


def test_unschedulable_rollout_workers_set_engines_pending_and_placement_clears_it() -> None:
    why = "0/2 nodes are available: 2 Insufficient nvidia.com/gpu."
    st = running(3, 0.5, engines=3)
    pods = [pod("w0"), pod("w1", "Pending", why), pod("w2", "Pending")]  # w2 is merely starting
    plan = plan_engines(spec(engines=3), st, st, NOW, pods)
    (cond,) = [c for c in plan.status["conditions"] if c["type"] == "EnginesPending"]
    assert (cond["status"], cond["reason"]) == ("True", "Unschedulable")
    assert cond["message"] == (
        "1 of 3 rollout workers for 3 engines cannot be scheduled (2 placed): "
        + why
        + "; the job continues on the engines it has"
    )
    # Placed later: the condition turns False; a job that never had the problem gets no condition.
    later = {**st, "conditions": plan.status["conditions"]}
    (cond,) = [c for c in plan_engines(spec(engines=3), later, later, NOW, [pod("w0")]).status["conditions"]]
    assert (cond["status"], cond["reason"]) == ("False", "AllScheduled")
    assert plan_engines(spec(engines=3), st, st, NOW, []).status["conditions"] == []
    assert "conditions" not in plan_engines(spec(engines=3), st, st, NOW, None).status
