"""The pure parts of the export upload: the plan, the marker, which keys are a previous export's, and
which failures are retried (the upload itself runs against the real S3 server in tests/e2e/io)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from botocore.exceptions import ClientError
from rlhf_trainer import export_upload
from rlhf_trainer.export_upload import MARKER, ExportFile, UploadError, marker_body, plan_upload, stale_keys
from rlhf_trainer.object_store import S3Url

pytestmark = pytest.mark.unit


def test_the_plan_lists_every_file_with_its_size_and_sha256_in_name_order(tmp_path: Path) -> None:
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "t.json").write_bytes(b"{}")
    (tmp_path / "b.safetensors").write_bytes(b"x" * 10)
    (tmp_path / "a.json").write_bytes(b"")
    assert plan_upload(tmp_path) == [
        ExportFile("a.json", 0, hashlib.sha256(b"").hexdigest()),
        ExportFile("b.safetensors", 10, hashlib.sha256(b"x" * 10).hexdigest()),
        ExportFile("tok/t.json", 2, hashlib.sha256(b"{}").hexdigest()),
    ]


def test_the_marker_is_deterministic_and_totals_the_files() -> None:
    files = [ExportFile("a", 3, "s1"), ExportFile("b", 4, "s2")]
    body = marker_body(files, 7)
    assert body == marker_body(list(files), 7)  # a re-upload writes the same bytes
    assert json.loads(body) == {
        "format": 1,
        "step": 7,
        "totalBytes": 7,
        "files": [{"name": "a", "size": 3, "sha256": "s1"}, {"name": "b", "size": 4, "sha256": "s2"}],
    }


def test_stale_keys_are_the_previous_exports_files_only() -> None:
    prefix = S3Url("bkt", "runs/model/")
    existing = ["runs/model/a", "runs/model/old-shard", f"runs/model/{MARKER}", "runs/model/tok/t.json"]
    files = [ExportFile("a", 1, "s"), ExportFile("tok/t.json", 1, "s")]
    assert stale_keys(existing, prefix, files) == ["runs/model/old-shard"]


def _error(code: str) -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": "m"}}, "PutObject")


def test_a_transient_failure_is_retried_with_backoff_and_a_refused_key_is_not() -> None:
    sleeps: list[float] = []
    outcomes: list[Any] = [_error("503"), _error("InternalError"), "ok"]

    def flaky() -> Any:
        outcome = outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    assert export_upload._retried(flaky, sleeps.append, where="s3://b/k") == "ok"
    assert sleeps == [1.0, 2.0]

    sleeps.clear()
    outcomes[:] = [_error("503")] * 3
    with pytest.raises(UploadError, match=r"^checkpoint.exportTo s3://b/k: .*\(after 3 attempt\(s\)\)"):
        export_upload._retried(flaky, sleeps.append, where="s3://b/k")
    assert sleeps == [1.0, 2.0]

    sleeps.clear()
    outcomes[:] = [_error("InvalidAccessKeyId")]
    with pytest.raises(UploadError, match=r"access refused \(InvalidAccessKeyId\).*\(after 1 attempt"):
        export_upload._retried(flaky, sleeps.append, where="s3://b/k")
    assert sleeps == []
