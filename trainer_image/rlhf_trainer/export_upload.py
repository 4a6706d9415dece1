"""The exported model to checkpoint.exportTo (s3://bucket/prefix), all or nothing for a reader: every file
first (multipart for large ones, through boto3's transfer manager), then a marker object listing them
(name, size, sha256), written last. A prefix without the marker is not a model (`read_marker`).

Owns the upload plan, the marker, the upload with its retries and byte progress, and the reader's check.
Must not touch the local export: a failed upload leaves it as it was. No Ray, no torch.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

from rlhf_trainer.object_store import S3Url, describe_error, error_code

MARKER = "rlhf-export-complete.json"  # written last; its presence is what makes the prefix a model
MARKER_FORMAT = 1
MULTIPART_THRESHOLD = 64 * 2**20  # a file above this goes up in parts of this size, several at once
UPLOAD_ATTEMPTS = 3  # per file, beyond botocore's own retries of each request
RETRY_BASE_SECONDS = 1.0
FIELD = "checkpoint.exportTo"


class UploadError(RuntimeError):
    """The upload failed for good; the message names checkpoint.exportTo and what happened."""


@dataclass(frozen=True)
class ExportFile:
    name: str  # relative to the export directory, with "/"
    size: int
    sha256: str


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def plan_upload(directory: Path) -> list[ExportFile]:
    """Every file of the export directory, in name order, with its size and sha256."""
    files = sorted(p for p in directory.rglob("*") if p.is_file())
    return [ExportFile(p.relative_to(directory).as_posix(), p.stat().st_size, sha256_of(p)) for p in files]


def marker_body(files: list[ExportFile], step: int | None) -> bytes:
    """The marker: what a complete export holds. Deterministic (no time), so a re-upload of the same
    export writes the same marker."""
    body = {
        "format": MARKER_FORMAT,
        "step": step,
        "files": [asdict(f) for f in files],
        "totalBytes": sum(f.size for f in files),
    }
    return (json.dumps(body, indent=1, sort_keys=True) + "\n").encode()


def stale_keys(existing: list[str], prefix: S3Url, files: list[ExportFile]) -> list[str]:
    """Keys under the prefix that the new export does not have (a previous export's), marker excluded."""
    keep = {prefix.child(f.name).key for f in files} | {prefix.child(MARKER).key}
    return sorted(k for k in existing if k not in keep)


@dataclass
class Progress:
    """Bytes of the export uploaded (or found already there) out of its total; `done` once the marker
    is written, `error` once it failed for good."""

    uri: str
    bytes_total: int = 0
    bytes_done: int = 0
    bytes_sent: int = 0  # of bytes_done, those uploaded by this run (the rest were there already)
    done: bool = False
    error: str | None = None


def upload_export(
    s3: Any,
    directory: Path,
    prefix: S3Url,
    *,
    step: int | None = None,
    progress: Progress | None = None,
    on_progress: Callable[[Progress], None] | None = None,
    sleep: Callable[[float], None] = time.sleep,
    part_bytes: int = MULTIPART_THRESHOLD,
) -> Progress:
    """Upload `directory` under `prefix`: the old marker removed first (the prefix stops being a model),
    each file uploaded unless the same bytes are there already (size and sha256 in its metadata), the
    previous export's other files deleted, the marker written last. Raises UploadError naming the field."""
    from boto3.s3.transfer import TransferConfig

    files = plan_upload(directory)
    state = progress or Progress(str(prefix))
    state.bytes_total, state.bytes_done, state.bytes_sent = sum(f.size for f in files), 0, 0
    state.done, state.error = False, None
    config = TransferConfig(multipart_threshold=part_bytes, multipart_chunksize=part_bytes)

    def advance(n: int, sent: bool = True) -> None:
        state.bytes_done += n
        state.bytes_sent += n if sent else 0
        if on_progress is not None:
            on_progress(state)

    try:
        marker = prefix.child(MARKER)
        _retried(partial(s3.delete_object, Bucket=prefix.bucket, Key=marker.key), sleep, where=str(marker))
        for f in files:
            key = prefix.child(f.name).key
            if _same_object(s3, prefix.bucket, key, f):
                advance(f.size, sent=False)
                continue
            _upload_file(s3, directory / f.name, prefix.bucket, key, f, config, advance, sleep)
        for key in stale_keys(_keys(s3, prefix), prefix, files):
            _retried(
                partial(s3.delete_object, Bucket=prefix.bucket, Key=key),
                sleep,
                where=f"s3://{prefix.bucket}/{key}",
            )
        body = marker_body(files, step)
        _retried(
            partial(s3.put_object, Bucket=prefix.bucket, Key=marker.key, Body=body), sleep, where=str(marker)
        )
    except UploadError as e:
        state.error = str(e)
        raise
    state.done = True
    if on_progress is not None:
        on_progress(state)
    return state


def _upload_file(
    s3: Any,
    path: Path,
    bucket: str,
    key: str,
    f: ExportFile,
    config: Any,
    advance: Callable[[int], None],
    sleep: Callable[[float], None],
) -> None:
    """One file through the transfer manager; a failed attempt's bytes are taken back from the progress."""
    sent = 0

    def callback(n: int) -> None:
        nonlocal sent
        sent += n
        advance(n)

    def attempt() -> None:
        nonlocal sent
        advance(-sent)
        sent = 0
        s3.upload_file(
            str(path),
            bucket,
            key,
            ExtraArgs={"Metadata": {"sha256": f.sha256}},
            Config=config,
            Callback=callback,
        )

    _retried(attempt, sleep, where=f"s3://{bucket}/{key}")


def _same_object(s3: Any, bucket: str, key: str, f: ExportFile) -> bool:
    """Whether `key` already holds this file (same size, same sha256 recorded at its upload)."""
    try:
        head = s3.head_object(Bucket=bucket, Key=key)
    except Exception as e:
        if type(e).__name__ == "ClientError" and error_code(e) in {"404", "NoSuchKey", "NotFound"}:
            return False
        raise UploadError(describe_error(e, FIELD, f"s3://{bucket}/{key}")) from e
    return int(head.get("ContentLength", -1)) == f.size and head.get("Metadata", {}).get("sha256") == f.sha256


def _keys(s3: Any, prefix: S3Url) -> list[str]:
    base = prefix.key.rstrip("/") + "/"
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=prefix.bucket, Prefix=base)
    return [str(o["Key"]) for page in pages for o in page.get("Contents", [])]


# Failures that another attempt cannot fix: the keys, the bucket, the request itself.
_PERMANENT = {
    "403",
    "AccessDenied",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "NoSuchBucket",
    "InvalidBucketName",
}


def _retried(call: Callable[[], Any], sleep: Callable[[float], None], where: str) -> Any:
    """`call`, again after 1 s and 2 s on a transient failure; UploadError once it fails for good."""
    for attempt in range(1, UPLOAD_ATTEMPTS + 1):
        try:
            return call()
        except Exception as e:
            cause = getattr(e, "last_exception", None) or e  # the transfer manager wraps the client's error
            permanent = error_code(cause) in _PERMANENT or type(cause).__name__ in {"NoCredentialsError"}
            if permanent or attempt == UPLOAD_ATTEMPTS:
                message = describe_error(cause, FIELD, where)
                raise UploadError(f"{message} (after {attempt} attempt(s))") from e
            sleep(RETRY_BASE_SECONDS * 2 ** (attempt - 1))
    raise AssertionError("unreachable")


def read_marker(s3: Any, prefix: S3Url) -> dict[str, Any]:
    """The marker of a complete export under `prefix`, its files checked present with their sizes;
    UploadError when the prefix is not a complete export (no marker: an upload unfinished or failed)."""
    try:
        body = s3.get_object(Bucket=prefix.bucket, Key=prefix.child(MARKER).key)["Body"].read()
    except Exception as e:
        if error_code(e) in {"404", "NoSuchKey"}:
            raise UploadError(
                f"{prefix}: not a complete export (no {MARKER}: an upload unfinished or failed)"
            ) from e
        raise UploadError(describe_error(e, FIELD, prefix)) from e
    marker: dict[str, Any] = json.loads(body)
    for f in marker["files"]:
        head = s3.head_object(Bucket=prefix.bucket, Key=prefix.child(f["name"]).key)
        if int(head["ContentLength"]) != f["size"]:
            raise UploadError(
                f"{prefix}: {f['name']} is {head['ContentLength']} bytes, the marker says {f['size']}"
            )
    return marker
