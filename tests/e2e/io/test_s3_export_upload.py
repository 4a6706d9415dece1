"""checkpoint.exportTo on the real S3 server: every file first (multipart for a large one), the marker
last; an upload cut off mid-way leaves no marker (and so no model); a second upload of the same export
sends nothing and writes the same marker; a refused key is reported and the local export is untouched."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
from rlhf_trainer.export_upload import MARKER, Progress, UploadError, read_marker, upload_export
from rlhf_trainer.object_store import S3Url
from testkit.object_store import ObjectStore

pytestmark = pytest.mark.io
BUCKET = "io-exports"
PART = 5 * 2**20  # S3's smallest part


class Killed(BaseException):
    """The driver's process dying mid-upload (nothing catches it, as nothing catches a SIGKILL)."""


def _export_dir(root: Path) -> Path:
    """An export directory's shape: shards (one above the part size, so multipart), index, config."""
    d = root / "model"
    (d / "tokenizer").mkdir(parents=True)
    (d / "model-00001-of-00002.safetensors").write_bytes(hashlib.sha256(b"a").digest() * (12 * 2**20 // 32))
    (d / "model-00002-of-00002.safetensors").write_bytes(b"b" * 1000)
    (d / "model.safetensors.index.json").write_text('{"weight_map": {}}\n')
    (d / "config.json").write_text('{"model_type": "llama"}\n')
    (d / "tokenizer" / "tokenizer.json").write_text("{}\n")
    return d


def _digests(d: Path) -> dict[str, str]:
    return {
        p.relative_to(d).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in d.rglob("*")
        if p.is_file()
    }


@pytest.fixture
def s3(object_store: ObjectStore) -> Any:
    object_store.bucket(BUCKET)
    return object_store.client()


def test_every_file_lands_before_the_marker_and_the_marker_lists_them(s3: Any, tmp_path: Path) -> None:
    d = _export_dir(tmp_path)
    prefix = S3Url(BUCKET, "run-1/model")
    seen: list[tuple[int, bool]] = []
    done = upload_export(
        s3, d, prefix, step=20, on_progress=lambda p: seen.append((p.bytes_done, p.done)), part_bytes=PART
    )
    total = sum(p.stat().st_size for p in d.rglob("*") if p.is_file())
    assert (done.bytes_total, done.bytes_done, done.bytes_sent, done.done) == (total, total, total, True)
    assert seen[-1] == (total, True) and all(not finished for _, finished in seen[:-1])
    marker = read_marker(s3, prefix)
    assert marker["step"] == 20 and marker["totalBytes"] == total
    assert {f["name"]: f["sha256"] for f in marker["files"]} == _digests(d)
    for name, digest in _digests(d).items():
        body = s3.get_object(Bucket=BUCKET, Key=f"run-1/model/{name}")["Body"].read()
        assert hashlib.sha256(body).hexdigest() == digest, name
    big = s3.head_object(Bucket=BUCKET, Key="run-1/model/model-00001-of-00002.safetensors")
    assert big["ETag"].strip('"').endswith("-3")  # 12 MiB in three parts of 5 MiB: a multipart upload


def test_an_upload_cut_off_mid_way_leaves_no_marker_so_no_model(s3: Any, tmp_path: Path) -> None:
    d = _export_dir(tmp_path)
    prefix = S3Url(BUCKET, "run-2/model")
    upload_export(s3, d, prefix, step=10, part_bytes=PART)  # a complete earlier export under the prefix
    (d / "config.json").write_text('{"model_type": "llama", "step": 20}\n')

    def die_after_first_file(p: Progress) -> None:
        if p.bytes_sent > 0:
            raise Killed

    with pytest.raises(Killed):
        upload_export(s3, d, prefix, step=20, on_progress=die_after_first_file, part_bytes=PART)
    keys = s3.list_objects_v2(Bucket=BUCKET, Prefix="run-2/model/")["Contents"]
    assert f"run-2/model/{MARKER}" not in {o["Key"] for o in keys}  # the old one went before any file
    with pytest.raises(UploadError, match=rf"s3://{BUCKET}/run-2/model: not a complete export \(no {MARKER}"):
        read_marker(s3, prefix)
    finished = upload_export(s3, d, prefix, step=20, part_bytes=PART)  # the next attempt completes it
    assert read_marker(s3, prefix)["step"] == 20 and finished.done


def test_a_second_upload_of_the_same_export_sends_nothing_and_drops_a_previous_exports_files(
    s3: Any, tmp_path: Path
) -> None:
    d = _export_dir(tmp_path)
    prefix = S3Url(BUCKET, "run-3/model")
    first = upload_export(s3, d, prefix, step=5, part_bytes=PART)
    marker = s3.get_object(Bucket=BUCKET, Key=f"run-3/model/{MARKER}")["Body"].read()
    again = upload_export(s3, d, prefix, step=5, part_bytes=PART)
    assert (again.bytes_done, again.bytes_sent, again.done) == (first.bytes_total, 0, True)
    assert s3.get_object(Bucket=BUCKET, Key=f"run-3/model/{MARKER}")["Body"].read() == marker
    (d / "model-00002-of-00002.safetensors").unlink()  # the next export has one shard fewer
    (d / "config.json").write_text('{"model_type": "llama", "changed": true}\n')
    third = upload_export(s3, d, prefix, step=6, part_bytes=PART)
    assert third.bytes_sent == len((d / "config.json").read_bytes())
    keys = {
        o["Key"].removeprefix("run-3/model/")
        for o in s3.list_objects_v2(Bucket=BUCKET, Prefix="run-3/model/")["Contents"]
    }
    assert keys == {*_digests(d), MARKER}


def test_a_refused_key_is_reported_naming_the_field_and_the_local_export_is_untouched(
    object_store: ObjectStore, s3: Any, tmp_path: Path
) -> None:
    d = _export_dir(tmp_path)
    before = _digests(d)
    wrong = object_store.client(aws_secret_access_key="wrong")
    sleeps: list[float] = []
    state = Progress(f"s3://{BUCKET}/run-4/model")
    with pytest.raises(
        UploadError,
        match=r"^checkpoint.exportTo .*: access refused \(SignatureDoesNotMatch\).* \(after 1 attempt",
    ):
        upload_export(
            wrong, d, S3Url(BUCKET, "run-4/model"), progress=state, sleep=sleeps.append, part_bytes=PART
        )
    assert sleeps == []  # refused keys are not retried: no attempt could succeed
    assert state.error is not None and "access refused" in state.error and not state.done
    assert _digests(d) == before
    assert "Contents" not in s3.list_objects_v2(Bucket=BUCKET, Prefix="run-4/")
