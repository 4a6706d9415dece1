"""The tracking sinks against the real backends, fed as the step loop feeds them (`Tracker.step` with the
step report as a dict): MLflow against the io stage's real server (read back through MLflow's client),
including a server stopped mid-run and restarted; W&B in offline mode (no W&B server can run here: the
online path is not run, docs/tracking.md); TensorBoard event files read back with TensorBoard's
EventAccumulator. No Ray, no pods: the sinks run in the driver, and this is the driver's code.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from rlhf_api.spec import RLHFJobSpec
from rlhf_trainer.loop import StepReport
from rlhf_trainer.metrics import TrainerExporter
from rlhf_trainer.tracking.dispatch import SampleRow
from rlhf_trainer.tracking.mlflow_sink import JOB_TAG
from rlhf_trainer.tracking.tracker import Tracker
from testkit.mlflow_server import MlflowServer, running_mlflow_server
from testkit.support import free_port
from testkit.wandb_records import config, history

pytestmark = pytest.mark.io

BASE = {
    "model": {"actor": "/models/actor", "reward": {"type": "function", "function": "rewards:score"}},
    "data": {"prompts": "/data/prompts.jsonl"},
}
ROWS = [SampleRow("user: 2+2?", "4", 1.0), SampleRow("say hi", "hi there", None)]


def spec_with(tracking: dict[str, Any]) -> RLHFJobSpec:
    return RLHFJobSpec.model_validate({**BASE, "tracking": tracking})


def report(step: int) -> dict[str, Any]:
    r = StepReport(
        step=step,
        phase_seconds={"generation": 1.0 + step, "actor_train": 0.5},
        reward_mean=0.1 * step,
        kl=0.01,
        generated_tokens=100,
        trained_tokens=90,
        reward_errors=0,
        valid_samples=8,
        tokens_per_second=50.0,
    )
    return asdict(r)


def sample(m: TrainerExporter, name: str, sink: str) -> float:
    return m.registry.get_sample_value(name, {"rlhfjob": "job-a", "sink": sink}) or 0.0


def _wait_until(check: Callable[[], bool], what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _tagged_mlflow_run(url: str, experiment: str) -> Any:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=url)
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None, f"no experiment {experiment} on {url}"
    runs = client.search_runs([exp.experiment_id], filter_string=f"tags.{JOB_TAG} = 'job-a'")
    assert len(runs) == 1, runs
    return client, exp.experiment_id, runs[0]


def test_mlflow_sink_logs_step_metrics_phase_timings_config_and_samples(
    mlflow_server: MlflowServer, tmp_path: Path
) -> None:
    spec = spec_with(
        {"mlflow": {"trackingUri": mlflow_server.url, "experiment": "sinks"}, "samplesEverySteps": 2}
    )
    m = TrainerExporter("job-a", CollectorRegistry())
    tracker = Tracker.start(spec, "job-a", m.tracking)
    assert tracker is not None
    for step in (1, 2, 3):
        tracker.step(step, report(step), ROWS if tracker.samples_due(step) else None)
    tracker.close(60)
    client, exp_id, run = _tagged_mlflow_run(mlflow_server.url, "sinks")
    rid = run.info.run_id
    assert [(x.step, round(x.value, 3)) for x in client.get_metric_history(rid, "reward_mean")] == [
        (1, 0.1),
        (2, 0.2),
        (3, 0.3),
    ]
    assert [x.value for x in client.get_metric_history(rid, "phase_seconds/generation")] == [2.0, 3.0, 4.0]
    params = client.get_run(rid).data.params
    assert params["model.actor"] == "/models/actor" and params["rlhfjob"] == "job-a"
    assert params["algorithm.totalSteps"] == str(spec.algorithm.total_steps)
    assert run.info.run_name == "job-a" and client.get_run(rid).info.status == "FINISHED"
    table = json.loads(
        Path(client.download_artifacts(rid, "samples/step_000002.json", str(tmp_path))).read_text()
    )
    assert table == {
        "columns": ["step", "prompt", "completion", "reward"],
        "data": [[2, "user: 2+2?", "4", 1.0], [2, "say hi", "hi there", None]],
    }
    url = f"{mlflow_server.url}/#/experiments/{exp_id}/runs/{rid}"
    assert m.registry.get_sample_value(
        "rlhf_tracking_run_info", {"rlhfjob": "job-a", "sink": "mlflow", "url": url}
    )
    assert sample(m, "rlhf_tracking_errors_total", "mlflow") == 0


def test_mlflow_stopped_mid_run_never_holds_a_step_and_the_sink_resumes_after_a_restart(
    tmp_path: Path,
) -> None:
    port = free_port()
    spec = spec_with({"mlflow": {"trackingUri": f"http://127.0.0.1:{port}", "experiment": "outage"}})
    m = TrainerExporter("job-a", CollectorRegistry())
    with running_mlflow_server(tmp_path, port=port) as server:
        tracker = Tracker.start(spec, "job-a", m.tracking)
        assert tracker is not None
        tracker.step(1, report(1))
        _wait_until(lambda: tracker.dispatchers[0].delivered == 2, "params and step 1 delivered")
    # the server is down: steps go on at their own pace, the failed calls are counted
    slowest = 0.0
    for step in (2, 3, 4):
        t0 = time.monotonic()
        tracker.step(step, report(step))
        slowest = max(slowest, time.monotonic() - t0)
    # a step never waits on the server: a step that did would sit through the retries' backoff (0.5 s,
    # then 1 s, ...); 1 s leaves room for a loaded machine
    assert slowest < 1.0, f"a step waited {slowest:.3f} s for the tracking server"
    _wait_until(lambda: sample(m, "rlhf_tracking_errors_total", "mlflow") >= 2, "failed calls counted")
    assert sample(m, "rlhf_tracking_up", "mlflow") == 0
    errors_while_down = sample(m, "rlhf_tracking_errors_total", "mlflow")
    with running_mlflow_server(tmp_path, port=port) as server:  # the same store, where the sink expects it
        _wait_until(lambda: tracker.dispatchers[0].pending() == 0, "the queued steps delivered", timeout=90)
        tracker.close(60)
        client, _, run = _tagged_mlflow_run(server.url, "outage")
        history = client.get_metric_history(run.info.run_id, "reward_mean")
    assert [x.step for x in history] == [1, 2, 3, 4]
    assert sample(m, "rlhf_tracking_dropped_total", "mlflow") == 0
    assert sample(m, "rlhf_tracking_up", "mlflow") == 1
    assert errors_while_down >= 2


def test_a_restarted_attempt_goes_on_with_the_run_though_a_param_changed(
    mlflow_server: MlflowServer,
) -> None:
    """After a restart the job's spec can differ (rollout.engines after a scale): MLflow refuses a changed
    param (400), so the resumed run keeps its params, adds new ones, and the steps go on."""
    spec = spec_with({"mlflow": {"trackingUri": mlflow_server.url, "experiment": "restarted"}})
    for attempt, engines in ((1, 2), (2, 1)):
        changed = spec.model_copy(update={"rollout": spec.rollout.model_copy(update={"engines": engines})})
        m = TrainerExporter("job-a", CollectorRegistry())
        tracker = Tracker.start(changed, "job-a", m.tracking)
        assert tracker is not None
        tracker.step(attempt, report(attempt))
        tracker.close(60)
        assert sample(m, "rlhf_tracking_dropped_total", "mlflow") == 0, attempt
    client, _, run = _tagged_mlflow_run(mlflow_server.url, "restarted")
    assert (
        run.data.params["rollout.engines"] == "2"
    )  # the first attempt's: MLflow keeps a param's first value
    assert [x.step for x in client.get_metric_history(run.info.run_id, "reward_mean")] == [1, 2]


def test_wandb_offline_writes_its_run_directory_with_the_metrics_config_and_samples(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    spec = spec_with({"wandb": {"project": "rlhf", "mode": "offline"}, "samplesEverySteps": 2})
    m = TrainerExporter("job-a", CollectorRegistry())
    tracker = Tracker.start(spec, "job-a", m.tracking)
    assert tracker is not None
    for step in (1, 2):
        tracker.step(step, report(step), ROWS if tracker.samples_due(step) else None)
    tracker.close(120)
    assert sample(m, "rlhf_tracking_errors_total", "wandb") == 0, tracker.dispatchers[0].last_error
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list(tmp_path.rglob("*"))
    run = runs[0]
    assert m.registry.get_sample_value(
        "rlhf_tracking_run_info", {"rlhfjob": "job-a", "sink": "wandb", "url": str(run)}
    )
    data = list(run.glob("*.wandb"))
    assert len(data) == 1, "no run data file"
    rows = history(data[0])  # what `wandb sync` would upload, read with wandb's own protobuf
    assert [(r["_step"], r["reward_mean"], r["phase_seconds/generation"]) for r in rows] == [
        ("1", "0.1", "2"),
        ("2", "0.2", "3"),
    ]
    assert json.loads(rows[1]["samples/_type"]) == "table-file" and "samples/_type" not in rows[0]
    table = json.loads((run / "files" / json.loads(rows[1]["samples/path"])).read_text())
    assert table["columns"] == ["step", "prompt", "completion", "reward"]
    assert table["data"] == [[2, "user: 2+2?", "4", 1.0], [2, "say hi", "hi there", None]]
    params = config(data[0])
    assert json.loads(params["model.actor"]) == "/models/actor" and json.loads(params["rlhfjob"]) == "job-a"


def test_tensorboard_event_files_hold_the_scalars_config_and_samples(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    spec = spec_with({"tensorboard": {"logDir": str(tmp_path)}, "samplesEverySteps": 2})
    m = TrainerExporter("job-a", CollectorRegistry())
    tracker = Tracker.start(spec, "job-a", m.tracking)
    assert tracker is not None
    for step in (1, 2, 3):
        tracker.step(step, report(step), ROWS if tracker.samples_due(step) else None)
    tracker.close(60)
    events = EventAccumulator(str(tmp_path / "job-a"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    assert [(e.step, round(e.value, 3)) for e in events.Scalars("reward_mean")] == [
        (1, 0.1),
        (2, 0.2),
        (3, 0.3),
    ]
    assert [e.value for e in events.Scalars("phase_seconds/generation")] == [2.0, 3.0, 4.0]
    config = events.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "| model.actor | /models/actor |" in config
    samples = events.Tensors("samples/text_summary")
    assert [e.step for e in samples] == [2]
    assert "| 2 | user: 2+2? | 4 | 1.0 |" in samples[0].tensor_proto.string_val[0].decode()
    assert m.registry.get_sample_value(
        "rlhf_tracking_run_info", {"rlhfjob": "job-a", "sink": "tensorboard", "url": str(tmp_path / "job-a")}
    )
