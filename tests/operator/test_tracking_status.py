"""The operator's side of spec.tracking (rlhf_operator.tracking): the head pod's credentials by Secret
reference only, and status.tracking and the TrackingHealthy condition from the trainer's real exporter's
rlhf_tracking_* series, scraped and applied as the operator does."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from rlhf_api.spec import RLHFJob, RLHFJobStatus
from rlhf_operator import manifests
from rlhf_operator.progress import apply_metrics
from rlhf_operator.scrape import parse_metrics
from rlhf_trainer.metrics import TrainerExporter

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
NOW = datetime(2026, 11, 28, 4, 0, tzinfo=UTC)
URL = "http://mlflow:5000/#/experiments/1/runs/abc"


def _tracked_job(tracking: dict[str, object]) -> RLHFJob:
    doc = yaml.safe_load((ROOT / "examples" / "rlhfjob-tiny.yaml").read_text())
    doc["metadata"]["namespace"] = "team-a"
    doc["spec"]["tracking"] = tracking
    return RLHFJob.model_validate(doc)


def env_of(rc: dict[str, object], role: str) -> list[dict[str, object]]:
    spec = rc["spec"]
    assert isinstance(spec, dict)
    groups = [spec["headGroupSpec"]] if role == "head" else spec["workerGroupSpecs"]
    return [e for g in groups for e in g["template"]["spec"]["containers"][0]["env"]]


def test_the_head_gets_the_named_secrets_keys_by_reference_and_no_worker_does() -> None:
    j = _tracked_job(
        {
            "mlflow": {
                "trackingUri": "http://mlflow:5000",
                "experiment": "e",
                "credentialsSecret": "mlflow-creds",
            },
            "wandb": {"project": "p", "apiKeySecret": "wandb-key"},
        }
    )
    rc = manifests.build_raycluster(j)
    refs = {
        e["name"]: e["valueFrom"]["secretKeyRef"]  # type: ignore[index]
        for e in env_of(rc, "head")
        if "valueFrom" in e
    }
    assert refs["MLFLOW_TRACKING_USERNAME"] == {
        "name": "mlflow-creds",
        "key": "MLFLOW_TRACKING_USERNAME",
        "optional": True,
    }
    assert refs["MLFLOW_TRACKING_TOKEN"]["name"] == "mlflow-creds"
    assert refs["WANDB_API_KEY"] == {"name": "wandb-key", "key": "WANDB_API_KEY", "optional": False}
    assert not any(str(e["name"]).startswith(("MLFLOW_", "WANDB_")) for e in env_of(rc, "worker"))
    runtime_env = json.dumps(manifests.trainer_runtime_env(j))
    assert "WANDB_API_KEY" not in runtime_env and "MLFLOW_TRACKING_" not in runtime_env


def test_no_tracking_adds_no_env() -> None:
    doc = yaml.safe_load((ROOT / "examples" / "rlhfjob-tiny.yaml").read_text())
    rc = manifests.build_raycluster(RLHFJob.model_validate(doc))
    assert not any(str(e["name"]).startswith(("MLFLOW_", "WANDB_")) for e in env_of(rc, "head"))


def applied(m: TrainerExporter, tracking: dict[str, object]) -> RLHFJobStatus:
    scraped = parse_metrics(generate_latest(m.registry).decode(), "j")
    st, _ = apply_metrics(RLHFJobStatus(), _tracked_job(tracking).spec, scraped, None, NOW)
    return st


MLFLOW = {
    "mlflow": {"trackingUri": "http://mlflow:5000", "experiment": "e"},
    "tensorboard": {"logDir": "/tb"},
}


def test_the_runs_reach_status_and_the_wide_columns_link() -> None:
    m = TrainerExporter("j", CollectorRegistry())
    m.tracking.tracking_started("tensorboard", "/tb/j")
    m.tracking.tracking_started("mlflow", URL)
    m.tracking.tracking_succeeded("mlflow")
    m.tracking.tracking_succeeded("tensorboard")
    st = applied(m, MLFLOW)
    assert st.tracking is not None
    assert (st.tracking.mlflow, st.tracking.tensorboard, st.tracking.wandb) == (URL, "/tb/j", None)
    assert st.tracking.link == URL  # MLflow first
    cond = next(c for c in st.conditions or [] if c.type == "TrackingHealthy")
    assert cond.status == "True"


def test_a_failing_sink_sets_tracking_healthy_false_naming_it_and_its_last_error() -> None:
    m = TrainerExporter("j", CollectorRegistry())
    m.tracking.tracking_started("mlflow", URL)
    m.tracking.tracking_succeeded("tensorboard")
    for _ in range(3):
        m.tracking.tracking_failed("mlflow", "ConnectionError: connection refused")
    m.tracking.tracking_dropped("mlflow", 2)
    st = applied(m, MLFLOW)
    cond = next(c for c in st.conditions or [] if c.type == "TrackingHealthy")
    assert (cond.status, cond.reason) == ("False", "SinkFailing")
    assert cond.message.startswith("mlflow: 3 failed calls, 2 events dropped; last error: ConnectionError")
    assert "tensorboard" not in cond.message


def test_no_condition_before_any_sink_reported_a_call() -> None:
    st = applied(TrainerExporter("j", CollectorRegistry()), MLFLOW)
    assert st.tracking is None
    assert not any(c.type == "TrackingHealthy" for c in st.conditions or [])
