"""What the sinks are given, from the step report and the spec (pure): the step's numbers as flat
`name -> float` metrics (phase timings as `phase_seconds/<phase>`), the spec as flat `path -> str` params,
and when a samples table is due.

Owns the names tracking backends show; never imports a backend or the step loop (the loop hands it the
report as a dict).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from rlhf_api.spec import RLHFJobSpec, TrackingSpec

# MLflow's limit on a param value (and a sane one for W&B's config and TensorBoard's text)
PARAM_VALUE_LIMIT = 6000
# Report fields that are not metrics: the step itself and identifiers
NOT_METRICS = frozenset({"step", "rollout_digest", "checkpoint", "engines"})


def step_metrics(report: dict[str, Any]) -> dict[str, float]:
    """A step report (`dataclasses.asdict(StepReport)`) as flat finite numbers: nested dicts joined with
    `/` (`phase_seconds/generation`, `training/policy_loss`, `evaluation/reward_mean`), booleans, strings,
    lists and non-finite values left out."""
    return {k: v for k, v in _numbers(report, "") if math.isfinite(v)}


def _numbers(node: dict[str, Any], prefix: str) -> Iterator[tuple[str, float]]:
    for key, value in node.items():
        if not prefix and key in NOT_METRICS:
            continue
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from _numbers(value, name + "/")
        elif isinstance(value, int | float) and not isinstance(value, bool):
            yield name, float(value)


def config_params(spec: RLHFJobSpec, job: str) -> dict[str, str]:
    """The spec as flat `dotted.camelCase.path -> value` params (lists and dicts as JSON-ish text, values
    cut at PARAM_VALUE_LIMIT), plus `rlhfjob`. Unset fields are left out; the tracking settings too (they
    name where the params go, not the experiment)."""
    wire = spec.model_dump(by_alias=True, exclude_none=True, mode="json")
    wire.pop("tracking", None)
    out = {"rlhfjob": job}
    for path, value in _leaves(wire, ""):
        text = str(value) if not isinstance(value, bool) else str(value).lower()
        out[path] = text if len(text) <= PARAM_VALUE_LIMIT else text[: PARAM_VALUE_LIMIT - 3] + "..."
    return out


def _leaves(node: dict[str, Any], prefix: str) -> Iterator[tuple[str, Any]]:
    for key, value in node.items():
        if isinstance(value, dict) and value:
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def samples_due(tracking: TrackingSpec | None, step: int) -> bool:
    """Whether step `step` logs a samples table (tracking.samplesEverySteps)."""
    every = tracking.samples_every_steps if tracking is not None else None
    return every is not None and step % every == 0
