"""The MLflow sink, through MLflow's own client (`MlflowClient`, no global active run, so the background
thread owns the run): the params once, a step's metrics in one batch, and the samples table as a JSON
artifact `samples/step_<step>.json` in the `{columns, data}` shape of `mlflow.log_table`.

A restarted attempt goes on with the job's run (found by the `rlhfjob` tag), so a run survives restarts.
Credentials come from env only (MLFLOW_TRACKING_USERNAME/PASSWORD or TOKEN, from the Secret).
"""

from __future__ import annotations

import json
import os
from typing import Any

from rlhf_api.spec import MlflowTrackingSpec

from rlhf_trainer.tracking.dispatch import SAMPLE_COLUMNS, SampleRow

JOB_TAG = "rlhfjob"
# MLflow's client retries a failed request itself (7 times, minutes in all): the dispatcher retries and
# counts instead, so each call fails fast. A user's own settings win.
CLIENT_ENV = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}


def run_url(tracking_uri: str, experiment_id: str, run_id: str) -> str:
    """The run's page in the MLflow UI."""
    return f"{tracking_uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"


def samples_table(step: int, rows: list[SampleRow]) -> dict[str, Any]:
    """A samples table in mlflow.log_table's JSON shape (pandas' `split` orient, without pandas)."""
    data = [[step, r.prompt, r.completion, r.reward] for r in rows]
    return {"columns": list(SAMPLE_COLUMNS), "data": data}


class MlflowSink:
    name = "mlflow"

    def __init__(self, spec: MlflowTrackingSpec, job: str) -> None:
        for key, value in CLIENT_ENV.items():
            os.environ.setdefault(key, value)
        self.spec, self.job = spec, job
        self.run_id = ""
        self._client: Any = None

    def open(self) -> str:
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=self.spec.tracking_uri)
        exp = client.get_experiment_by_name(self.spec.experiment)
        exp_id = exp.experiment_id if exp is not None else client.create_experiment(self.spec.experiment)
        found = client.search_runs(
            [exp_id],
            filter_string=f"tags.{JOB_TAG} = '{self.job}'",
            max_results=1,
            order_by=["start_time DESC"],
        )
        if found:
            self.run_id = found[0].info.run_id
            client.update_run(self.run_id, status="RUNNING")
        else:
            run = client.create_run(exp_id, run_name=self.spec.run_name or self.job, tags={JOB_TAG: self.job})
            self.run_id = run.info.run_id
        self._client = client
        return run_url(self.spec.tracking_uri, exp_id, self.run_id)

    def permanent(self, error: BaseException) -> bool:
        """A 4xx answer (a bad or refused request) is permanent; unreachable, 5xx, 408 and 429 are not."""
        from mlflow.exceptions import MlflowException

        if not isinstance(error, MlflowException):
            return False
        status = int(error.get_http_status_code())  # type: ignore[no-untyped-call]
        return 400 <= status < 500 and status not in (408, 429)

    def log_params(self, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        # A resumed run keeps the params it has: MLflow refuses a changed value (400), and a restarted
        # attempt's spec can differ where the job was changed while it ran (rollout.engines after a scale).
        kept = self._client.get_run(self.run_id).data.params if self._client is not None else {}
        items = [Param(k, v) for k, v in sorted(params.items()) if k not in kept]
        for i in range(0, len(items), 100):  # MLflow's batch limit on params
            self._client.log_batch(self.run_id, params=items[i : i + 100])

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(k, v, now, step) for k, v in sorted(metrics.items())]
        for i in range(0, len(items), 1000):  # MLflow's batch limit on metrics
            self._client.log_batch(self.run_id, metrics=items[i : i + 1000])

    def log_samples(self, step: int, rows: list[SampleRow]) -> None:
        text = json.dumps(samples_table(step, rows))
        self._client.log_text(self.run_id, text, f"samples/step_{step:06d}.json")

    def close(self) -> None:
        self._client.set_terminated(self.run_id, status="FINISHED")
