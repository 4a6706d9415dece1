"""The built-in rollout-engine autoscaler (docs/autoscaling.md): recent generation shares -> the next engine
count, with a dead band, a step window, a cooldown and the [minEngines, maxEngines] range; and the plan
of one reconcile (clamp, policy, change bookkeeping, the EnginesPending condition).
Pure: no clock, no I/O, no kopf or Kubernetes client; the handler applies the plan and emits its Events.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from rlhf_api.spec import AutoscalingSpec, RLHFJobSpec

from rlhf_operator.conditions import iso, parse_time, set_condition

Direction = Literal["up", "down", "hold"]
# (step, generation share of that step): one entry per completed step the operator observed.
Sample = tuple[int, float]

# Event reasons (CamelCase). A change is GenerationBound, TrainingBound or EnginesClamped; the rest hold.
GENERATION_BOUND = "GenerationBound"
TRAINING_BOUND = "TrainingBound"
CLAMPED = "EnginesClamped"
COOLDOWN = "Cooldown"
INSIDE_BAND = "InsideBand"
NOT_SUSTAINED = "NotSustained"
NOT_ENOUGH_DATA = "NotEnoughData"
AT_MAX = "AtMax"
AT_MIN = "AtMin"
DISABLED = "Disabled"


@dataclass(frozen=True)
class ScaleDecision:
    """The engine count to run (`target`), which way it moved, a CamelCase `reason` and a `message`
    with the numbers, e.g. "generation 72% > 65% (target 55% + 10%) for 3 steps: engines 2→3"."""

    target: int
    direction: Direction
    reason: str
    message: str

    @property
    def changed(self) -> bool:
        """Whether the engine count changes (an Event, and a new lastScaleTime/lastScaleStep)."""
        return self.direction != "hold"


def clamp_request(requested: int, autoscaling: AutoscalingSpec) -> tuple[int, str | None]:
    """The engine count to run for a requested `spec.rollout.engines`, and why it differs (or None).

    With autoscaling enabled, a request outside [minEngines, maxEngines] (a `kubectl scale` or an
    external autoscaler; the API server accepts it, the CEL range rule applies on create only) is
    clamped into the range. With autoscaling off there is no range: the request is run as it is.
    """
    if not autoscaling.enabled:
        return requested, None
    low, high = autoscaling.min_engines, autoscaling.max_engines
    if requested < low:
        return (
            low,
            f"requested {requested} engines, below rollout.autoscaling.minEngines {low}: running {low}",
        )
    if requested > high:
        return (
            high,
            f"requested {requested} engines, above rollout.autoscaling.maxEngines {high}: running {high}",
        )
    return requested, None


def decide_scale(
    history: Sequence[Sample],
    current_engines: int,
    autoscaling: AutoscalingSpec,
    now: datetime,
    last_scale_time: datetime | None,
    last_scale_step: int | None = None,
    engines_per_step: int = 1,
) -> ScaleDecision:
    """The next engine count from the recent generation shares (`history`, see `append_history`).

    In order: off → hold (Disabled); outside [min, max] → clamp (EnginesClamped, ignores the
    cooldown); within `cooldownSeconds` of `last_scale_time` → hold (Cooldown); fewer than
    `windowSteps` usable steps → hold (NotEnoughData). Usable steps are those that started after the
    last change: steps after `last_scale_step + 1`, because step `last_scale_step + 1` was already
    running, with the old count, when the count changed. Then, over the last `windowSteps` usable steps:
    every share above target + hysteresis → one more step of engines (GenerationBound; AtMax at the
    top), every share below target - hysteresis → one fewer (TrainingBound; AtMin at the bottom),
    otherwise hold (InsideBand when the latest share is inside the band, NotSustained when it is out
    but not for the whole window). `engines_per_step` is the size of one step (1, or the engines of one
    rollout worker so that workers are never half used); the target stays within [min, max].
    """
    if engines_per_step < 1:
        raise ValueError(f"engines_per_step must be at least 1, got {engines_per_step}")
    current = current_engines

    def hold(reason: str, why: str) -> ScaleDecision:
        return ScaleDecision(current, "hold", reason, f"{why}: engines stay {current}")

    if not autoscaling.enabled:
        return hold(DISABLED, "built-in autoscaling is off (rollout.autoscaling.enabled is false)")
    clamped, why_clamped = clamp_request(current, autoscaling)
    if why_clamped is not None:
        return ScaleDecision(clamped, "up" if clamped > current else "down", CLAMPED, why_clamped)
    if last_scale_time is not None:
        elapsed = (now - last_scale_time).total_seconds()
        if elapsed < autoscaling.cooldown_seconds:
            return hold(
                COOLDOWN,
                f"last change {int(elapsed)}s ago, within cooldownSeconds {autoscaling.cooldown_seconds}",
            )
    window = autoscaling.window_steps
    usable = sorted((step, share) for step, share in history if _valid(share))
    if last_scale_step is not None:
        usable = [(step, share) for step, share in usable if step > last_scale_step + 1]
    recent = [share for _, share in usable[-window:]]
    if len(recent) < window:
        since = " since the last change" if last_scale_step is not None else ""
        return hold(NOT_ENOUGH_DATA, f"generation share of {len(recent)} of {window} steps observed{since}")
    return _against_band(recent, current, autoscaling, engines_per_step)


def _against_band(
    recent: Sequence[float], current: int, autoscaling: AutoscalingSpec, engines_per_step: int
) -> ScaleDecision:
    """The window's shares against target ± hysteresis: one step up, one step down, or hold."""
    window = len(recent)

    def hold(reason: str, why: str) -> ScaleDecision:
        return ScaleDecision(current, "hold", reason, f"{why}: engines stay {current}")

    target, band = autoscaling.target_generation_share, autoscaling.hysteresis
    # Rounded so that a share exactly on a threshold counts as inside the band on both sides.
    upper, lower = round(target + band, 9), round(target - band, 9)
    seen = _span(recent)
    if all(share > upper for share in recent):
        above = f"generation {seen} > {_pct(upper)} (target {_pct(target)} + {_pct(band)}) for {window} steps"
        if current >= autoscaling.max_engines:
            return hold(AT_MAX, f"{above}, but at maxEngines {autoscaling.max_engines}")
        new = min(autoscaling.max_engines, current + engines_per_step)
        return ScaleDecision(new, "up", GENERATION_BOUND, f"{above}: engines {current}→{new}")
    if all(share < lower for share in recent):
        below = f"generation {seen} < {_pct(lower)} (target {_pct(target)} - {_pct(band)}) for {window} steps"
        if current <= autoscaling.min_engines:
            return hold(AT_MIN, f"{below}, but at minEngines {autoscaling.min_engines}")
        new = max(autoscaling.min_engines, current - engines_per_step)
        return ScaleDecision(new, "down", TRAINING_BOUND, f"{below}: engines {current}→{new}")
    latest = recent[-1]
    band_text = f"{_pct(lower)}-{_pct(upper)} (target {_pct(target)} ± {_pct(band)})"
    if lower <= latest <= upper:
        return hold(INSIDE_BAND, f"generation {_pct(latest)} inside {band_text}")
    shares = ", ".join(_pct(share) for share in recent)
    return hold(
        NOT_SUSTAINED, f"generation {shares} over the last {window} steps: not all outside {band_text}"
    )


def append_history(history: Sequence[Sample], step: int, share: float, keep: int) -> list[Sample]:
    """`history` with the share of `step` added, oldest first, at most the last `keep` entries.

    One entry per step: a step already present is replaced, and every entry after it is dropped,
    because steps only go back when a restart from a checkpoint re-runs them (their old shares belong
    to the previous attempt). Step 0 (nothing completed yet) and a share that is not a number in
    [0, 1] are no data: the history comes back unchanged (trimmed to `keep`). `keep` of
    `rollout.autoscaling.windowSteps` is all the policy reads.
    """
    if keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}")
    ordered = sorted(history)
    if step < 1 or not _valid(share):
        return ordered[-keep:]
    kept = [(s, x) for s, x in ordered if s < step]
    kept.append((step, share))
    return kept[-keep:]


def history_from_status(items: Sequence[Mapping[str, Any]] | None) -> list[Sample]:
    """`status.rollout.generationShareHistory` (`[{step, share}]`) as samples, oldest first."""
    return sorted((int(item["step"]), float(item["share"])) for item in items or [])


def history_to_status(history: Sequence[Sample]) -> list[dict[str, Any]]:
    """Samples as `status.rollout.generationShareHistory`, shares rounded to 4 digits."""
    return [{"step": step, "share": round(share, 4)} for step, share in history]


def _valid(share: float) -> bool:
    return math.isfinite(share) and 0.0 <= share <= 1.0


def _pct(x: float) -> str:
    """72%, or 72.5% when the whole number would hide the difference that matters."""
    percent = x * 100
    if abs(percent - round(percent)) < 0.05:
        return f"{round(percent)}%"
    return f"{percent:.1f}%"


def _span(shares: Sequence[float]) -> str:
    """72%, or 68%-75% over several different shares."""
    low, high = _pct(min(shares)), _pct(max(shares))
    return low if low == high else f"{low}-{high}"


# ------------------------------------------------------------------------------- the reconcile-level plan

# Event reason: spec.rollout.engines changed by someone else (kubectl scale, an HPA, KEDA).
CHANGED_BY_REQUEST = "EnginesScaled"
ENGINES_PENDING = "EnginesPending"  # condition type: rollout workers the cluster cannot place
UNSCHEDULABLE = "Unschedulable"
ALL_SCHEDULED = "AllScheduled"


@dataclass(frozen=True)
class EnginePlan:
    """What one reconcile does about the engine count; the handler applies it.

    `write_spec` means `spec.rollout.engines` must become `engines` (a clamp or a policy decision; the
    handler writes it with a JSON-patch `test` on `requested`, so a concurrent `kubectl scale` wins).
    `status` holds the status fields to merge (rollout, lastScaleTime, lastScaleStep, conditions);
    `events` are (type, reason, message); `decision` is the built-in policy's verdict (None when it did
    not run) and `direction` the way an operator decision moved the count (for the decisions metric).
    """

    engines: int
    requested: int
    write_spec: bool
    status: dict[str, Any]
    events: list[tuple[str, str, str]]
    decision: ScaleDecision | None = None
    direction: Direction | None = None


def plan_engines(
    spec: RLHFJobSpec,
    previous: Mapping[str, Any],
    status: Mapping[str, Any],
    now: datetime,
    rollout_pods: Sequence[Mapping[str, Any]] | None = None,
) -> EnginePlan:
    """The engine count to run this round, from the spec, the last written status and the new one.

    `previous` is the status as stored (what ran until now), `status` the one `status.decide` just
    computed (step and generationShare of this round). In order: a request outside [min, max] is
    clamped (Warning EnginesClamped); otherwise, while the job is Running with autoscaling on, the
    step's share joins `rollout.generationShareHistory` and `decide_scale` may move the count. Any
    change of the running count (ours or a `kubectl scale`) records lastScaleTime/lastScaleStep, so the
    cooldown and the window restart from it. `rollout_pods` (None: not observed) sets the
    EnginesPending condition when the scheduler cannot place rollout workers; the job keeps running.
    """
    autoscaling = spec.rollout.autoscaling
    requested = spec.rollout.engines
    step = int(status.get("step") or 0)
    rollout = dict(status.get("rollout") or {})
    prev_desired = (previous.get("rollout") or {}).get("desiredEngines")
    events: list[tuple[str, str, str]] = []
    engines, why_clamped = clamp_request(requested, autoscaling)
    decision: ScaleDecision | None = None
    direction: Direction | None = None

    if why_clamped is not None:
        moved = f" (engines {prev_desired}→{engines})" if prev_desired not in (None, engines) else ""
        events.append(("Warning", CLAMPED, why_clamped + moved))
        direction = "up" if engines > requested else "down"
    elif autoscaling.enabled:
        decision = _autoscale(spec, previous, status, rollout, engines, now)
        if decision is not None and decision.changed:
            engines, direction = decision.target, decision.direction
            events.append(("Normal", decision.reason, decision.message))
    else:
        rollout.pop("generationShareHistory", None)

    out: dict[str, Any] = {}
    if prev_desired is not None and engines != int(prev_desired):
        out["lastScaleTime"] = iso(now)
        out["lastScaleStep"] = step
        if direction is None:  # nobody here decided it: the request itself changed
            workers = (
                f"rollout workers {spec.rollout.replicas(int(prev_desired))}→{spec.rollout.replicas(engines)}"
            )
            events.append(
                ("Normal", CHANGED_BY_REQUEST, f"spec.rollout.engines {prev_desired}→{engines}: {workers}")
            )
    rollout["desiredEngines"] = engines
    out["rollout"] = rollout
    if rollout_pods is not None:
        out["conditions"] = _pending_condition(spec, status, rollout_pods, engines, now)
    return EnginePlan(engines, requested, engines != requested, out, events, decision, direction)


def _autoscale(
    spec: RLHFJobSpec,
    previous: Mapping[str, Any],
    status: Mapping[str, Any],
    rollout: dict[str, Any],
    engines: int,
    now: datetime,
) -> ScaleDecision | None:
    """While the job is Running: its step's share joins `rollout`'s generationShareHistory (updated in
    place) and the policy decides (`decide_scale`); None in any other phase."""
    autoscaling = spec.rollout.autoscaling
    history = history_from_status(rollout.get("generationShareHistory"))
    share = status.get("generationShare")
    if status.get("phase") != "Running":
        return None
    if share is not None:
        step = int(status.get("step") or 0)
        history = append_history(history, step, float(share), keep=autoscaling.window_steps)
        rollout["generationShareHistory"] = history_to_status(history)
    return decide_scale(
        history,
        engines,
        autoscaling,
        now,
        parse_time(previous.get("lastScaleTime")),
        previous.get("lastScaleStep"),
        engines_per_step=spec.rollout.engines_per_worker,
    )


def _pending_condition(
    spec: RLHFJobSpec,
    status: Mapping[str, Any],
    rollout_pods: Sequence[Mapping[str, Any]],
    engines: int,
    now: datetime,
) -> list[dict[str, Any]]:
    """`status`'s conditions with EnginesPending set while the scheduler cannot place rollout workers."""
    conditions = list(status.get("conditions") or [])
    pending = engines_pending(rollout_pods, engines, spec.rollout.replicas(engines))
    if pending is not None:
        return set_condition(conditions, ENGINES_PENDING, True, UNSCHEDULABLE, pending, now)
    if any(c.get("type") == ENGINES_PENDING for c in conditions):
        message = "every rollout worker is placed"
        return set_condition(conditions, ENGINES_PENDING, False, ALL_SCHEDULED, message, now)
    return conditions


def engines_pending(pods: Sequence[Mapping[str, Any]], engines: int, workers: int) -> str | None:
    """Why some rollout workers cannot run (the scheduler's message), or None when none is unplaceable.

    Only pods the scheduler marked Unschedulable count: a pod that is merely starting is not a problem.
    The message carries counts, not durations, so it is stable while the situation lasts.
    """
    stuck: list[str] = []
    for pod in pods:
        st = pod.get("status") or {}
        if st.get("phase") != "Pending" or (pod.get("metadata") or {}).get("deletionTimestamp"):
            continue
        for c in st.get("conditions") or []:
            if (
                c.get("type") == "PodScheduled"
                and c.get("status") == "False"
                and c.get("reason") == UNSCHEDULABLE
            ):
                stuck.append(str(c.get("message") or "no reason given").strip())
    if not stuck:
        return None
    placed = max(
        0, len([p for p in pods if not (p.get("metadata") or {}).get("deletionTimestamp")]) - len(stuck)
    )
    return (
        f"{len(stuck)} of {workers} rollout workers for {engines} engines cannot be scheduled "
        f"({placed} placed): {stuck[0]}; the job continues on the engines it has"
    )
