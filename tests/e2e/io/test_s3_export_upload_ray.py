"""The driver's side of checkpoint.exportTo: the upload runs in a Ray actor (pinned to a trainer node on
a cluster; anywhere on this local Ray) with the pod's AWS variables, its progress polled into the
callback the driver feeds its metrics from; a refused key comes back as the result's error, not raised."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from rlhf_trainer.export import upload_on_trainer
from rlhf_trainer.export_upload import MARKER, read_marker
from rlhf_trainer.object_store import S3Url
from testkit.object_store import ObjectStore

pytestmark = pytest.mark.io
BUCKET = "io-ray-exports"


@pytest.fixture
def local_ray(object_store: ObjectStore, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A private local Ray whose workers have the AWS variables, as a pod's raylet has its container's."""
    import ray

    for name, value in object_store.env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def test_the_upload_runs_in_a_ray_actor_reporting_progress_and_failure_without_raising(
    object_store: ObjectStore, local_ray: None, tmp_path: Path
) -> None:
    export = tmp_path / "model"
    export.mkdir()
    (export / "model.safetensors").write_bytes(os.urandom(3 * 2**20))
    (export / "config.json").write_text("{}\n")
    object_store.bucket(BUCKET)
    seen: list[dict[str, Any]] = []
    result = upload_on_trainer(export, f"s3://{BUCKET}/run/model", 12, seen.append, poll_seconds=0.05)
    total = 3 * 2**20 + 3
    assert (result["error"], result["done"], result["bytes_done"], result["bytes_total"]) == (
        None,
        True,
        total,
        total,
    )
    assert seen[-1] == result
    assert all(p["bytes_done"] <= p["bytes_total"] == total for p in seen if p["bytes_total"])
    assert read_marker(object_store.client(), S3Url(BUCKET, "run/model"))["step"] == 12

    # A bucket that does not exist fails for good: reported in the result (and so in the metrics), not raised.
    failed = upload_on_trainer(export, "s3://no-such-bucket/run/model", 12, seen.append, poll_seconds=0.05)
    assert failed["done"] is False and seen[-1] == failed
    assert failed["error"] == (
        f"checkpoint.exportTo s3://no-such-bucket/run/model/{MARKER}: no such bucket (after 1 attempt(s))"
    )
    assert (export / "config.json").read_text() == "{}\n"
