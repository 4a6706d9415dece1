"""The driver's handle on the configured sinks: builds one dispatcher per sink from spec.tracking and
fans each step out to them (config once at start, metrics every step, samples when due).

Owns which sinks exist and the order of events; never blocks the step (dispatch.py) and never imports the
step loop (the loop hands it the report as a dict).
"""

from __future__ import annotations

import time
from typing import Any

from rlhf_api.spec import RLHFJobSpec, TrackingSpec

from rlhf_trainer.tracking.dispatch import Event, Observer, SampleRow, Sink, SinkDispatcher
from rlhf_trainer.tracking.report import config_params, samples_due, step_metrics

# How long the driver's exit waits for queued events (per sink, at once): a slow backend must not hold up
# the job's completion for long; what is left is counted as dropped.
CLOSE_SECONDS = 20.0


def build_sinks(tracking: TrackingSpec, job: str) -> list[Sink]:
    """The sinks spec.tracking names (imports of the backends are deferred to each sink's open)."""
    from rlhf_trainer.tracking.mlflow_sink import MlflowSink
    from rlhf_trainer.tracking.tensorboard_sink import TensorBoardSink
    from rlhf_trainer.tracking.wandb_sink import WandbSink

    sinks: list[Sink] = []
    if tracking.mlflow is not None:
        sinks.append(MlflowSink(tracking.mlflow, job))
    if tracking.wandb is not None:
        sinks.append(WandbSink(tracking.wandb, job))
    if tracking.tensorboard is not None:
        sinks.append(TensorBoardSink(tracking.tensorboard, job))
    return sinks


class Tracker:
    """Dispatchers for the job's sinks; `step` is called once per completed step, from the step loop."""

    def __init__(self, tracking: TrackingSpec, dispatchers: list[SinkDispatcher]) -> None:
        self.tracking = tracking
        self.dispatchers = dispatchers

    @classmethod
    def start(
        cls, spec: RLHFJobSpec, job: str, observer: Observer, sinks: list[Sink] | None = None
    ) -> Tracker | None:
        """Start the sinks' threads and queue the config; None when spec.tracking is unset."""
        if spec.tracking is None:
            return None
        chosen = sinks if sinks is not None else build_sinks(spec.tracking, job)
        tracker = cls(spec.tracking, [SinkDispatcher(s, observer).start() for s in chosen])
        tracker._submit(Event("params", 0, config_params(spec, job)))
        return tracker

    @property
    def samples_per_table(self) -> int:
        return self.tracking.samples_per_table

    def samples_due(self, step: int) -> bool:
        return samples_due(self.tracking, step)

    def step(self, step: int, report: dict[str, Any], rows: list[SampleRow] | None = None) -> None:
        """Queue the step's metrics (and its samples table); returns at once."""
        self._submit(Event("metrics", step, step_metrics(report)))
        if rows:
            self._submit(Event("samples", step, rows))

    def close(self, timeout: float = CLOSE_SECONDS) -> None:
        """Flush every sink within `timeout` seconds in all (one deadline, not one per sink)."""
        deadline = time.monotonic() + timeout
        for d in self.dispatchers:
            d.close(max(0.5, deadline - time.monotonic()))

    def _submit(self, event: Event) -> None:
        for d in self.dispatchers:
            d.submit(event)
