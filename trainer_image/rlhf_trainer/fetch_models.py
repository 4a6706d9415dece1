"""The `fetch-models` step: fetch every `hf://` and `s3://` model of a job into the model cache before the
trainer starts, once per source and revision (a complete entry is reused: 0 bytes), printing progress
lines the operator reads, and ending a permanent failure with a classified termination message.
Transfers go through huggingface_hub and boto3 only. Run as `python -m rlhf_trainer.fetch_models`.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlhf_api.constants import INPUT_ERROR_EXIT_CODE
from rlhf_api.model_source import (
    FETCH_LOG_MARKER,
    ModelSource,
    entry_dir,
    local_model_path,
    parse_source,
    s3_revision_key,
)

from rlhf_trainer.config import InputError, load_spec_arg
from rlhf_trainer.model_cache import (
    PERMANENT_REASONS,
    FetchError,
    RemoteFile,
    entry_complete,
    mark_complete,
    point_current,
    reset_entry,
    safe_name,
    termination_message,
)

# Hub files a model needs (weights as safetensors, configs, tokenizers, chat templates); a repository's
# other formats (.bin, .onnx, .gguf) would double the download. An s3:// prefix is taken whole.
HF_PATTERNS = ["*.safetensors", "*.json", "*.model", "*.txt", "*.jinja", "*.tiktoken", "*.py"]
TERMINATION_LOG = "/dev/termination-log"

Progress = Callable[[int], None]  # called with bytes just transferred


@dataclass
class Resolved:
    """One remote model, resolved to a revision and its files; `cached` when a complete entry exists."""

    field: str
    source: ModelSource
    revision: str
    files: list[RemoteFile]
    entry: Path
    cached: bool = False

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)


@dataclass
class FetchSummary:
    """What a fetch did: bytes transferred (0 when every model was cached) and each model's load path."""

    bytes_fetched: int = 0
    bytes_total: int = 0
    paths: dict[str, str] = field(default_factory=dict)


# ------------------------------------------------------------------------------------------------ s3


def classify_s3(error: Exception, field: str, source: ModelSource) -> FetchError:
    """botocore's errors as a failure class: a missing bucket or object is ModelNotFound, a refused or
    absent key CredentialsRefused, anything else FetchFailed (retried by the pod's restarts)."""
    from botocore.exceptions import ClientError, NoCredentialsError, PartialCredentialsError

    where = source.uri
    if isinstance(error, NoCredentialsError | PartialCredentialsError):
        return FetchError(
            "CredentialsRefused", field, f"{where}: no S3 credentials (storage.s3.credentialsSecret)"
        )
    if isinstance(error, ClientError):
        code = str(error.response.get("Error", {}).get("Code", ""))
        status = int(error.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        if code in ("NoSuchBucket", "NoSuchKey", "404") or status == 404:
            return FetchError("ModelNotFound", field, f"{where}: {code or 'not found'}")
        if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "ExpiredToken", "403") or (
            status in (401, 403)
        ):
            return FetchError(
                "CredentialsRefused", field, f"{where}: the store refused the credentials ({code})"
            )
    return FetchError("FetchFailed", field, f"{where}: {type(error).__name__}: {error}")


def s3_client() -> Any:
    """boto3's S3 client from the standard variables (AWS_ACCESS_KEY_ID, ..., AWS_ENDPOINT_URL), read now:
    a new session each fetch (boto3's default session keeps the first credentials it resolved)."""
    import boto3

    return boto3.session.Session().client("s3")


def resolve_s3(client: Any, field: str, source: ModelSource, cache_root: str) -> Resolved:
    """List the prefix: its objects are the files, their ETags the revision. No objects: ModelNotFound."""
    prefix = source.prefix + "/" if source.prefix else ""
    files: list[RemoteFile] = []
    try:
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=source.bucket, Prefix=prefix):
            for obj in page.get("Contents", []):
                if obj["Key"].endswith("/"):
                    continue
                name = safe_name(obj["Key"][len(prefix) :])
                files.append(RemoteFile(name, int(obj["Size"]), obj["Key"] + "\t" + obj.get("ETag", "")))
    except Exception as e:
        raise classify_s3(e, field, source) from e
    if not files:
        raise FetchError("ModelNotFound", field, f"{source.uri}: no objects under this prefix")
    revision = s3_revision_key([(f.name, f.key.split("\t", 1)[1], f.size) for f in files])
    entry = Path(entry_dir(source, cache_root, revision))
    return Resolved(field, source, revision, files, entry)


def download_s3(client: Any, item: Resolved, progress: Progress) -> None:
    """Each object through boto3's transfer manager (multipart, its byte callbacks for progress)."""
    for f in item.files:
        target = item.entry / f.name
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            client.download_file(item.source.bucket, f.key.split("\t", 1)[0], str(target), Callback=progress)
        except Exception as e:
            raise classify_s3(e, item.field, item.source) from e


# ------------------------------------------------------------------------------------------------ hf


def classify_hf(error: Exception, field: str, source: ModelSource) -> FetchError:
    """huggingface_hub's errors as a failure class. A private repository without a token answers as a
    missing one (the Hub's 401), so ModelNotFound says to check the token too."""
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = source.uri
    if isinstance(error, GatedRepoError):  # before its base class RepositoryNotFoundError
        return FetchError("CredentialsRefused", field, f"{where}: gated repository: the token has no access")
    if isinstance(error, RevisionNotFoundError):
        return FetchError(
            "RevisionNotFound", field, f"{where}: revision {source.revision or 'main'} not found"
        )
    if isinstance(error, RepositoryNotFoundError | RemoteEntryNotFoundError):
        return FetchError(
            "ModelNotFound",
            field,
            f"{where}: repository not found (or private: check storage.huggingFace.tokenSecret)",
        )
    response = error.response if isinstance(error, HfHubHTTPError) else None
    if response is not None and response.status_code in (401, 403):
        return FetchError("CredentialsRefused", field, f"{where}: the Hub refused the token")
    return FetchError("FetchFailed", field, f"{where}: {type(error).__name__}: {error}")


def resolve_hf(field: str, source: ModelSource, cache_root: str, token: str | None) -> Resolved:
    """The revision's commit and file sizes from the Hub's API (HF_ENDPOINT honoured by the library)."""
    from fnmatch import fnmatch

    from huggingface_hub import HfApi

    try:
        info = HfApi(token=token).model_info(source.repo, revision=source.revision, files_metadata=True)
    except Exception as e:
        raise classify_hf(e, field, source) from e
    files = [
        RemoteFile(s.rfilename, int(s.size or 0))
        for s in info.siblings or []
        if any(fnmatch(s.rfilename, p) for p in HF_PATTERNS)
    ]
    revision = str(info.sha)
    return Resolved(field, source, revision, files, Path(entry_dir(source, cache_root, revision)))


def download_hf(item: Resolved, token: str | None, progress: Progress) -> None:
    """snapshot_download of the resolved commit into the entry (progress per model: the Hub's files
    arrive in parallel)."""
    from huggingface_hub import snapshot_download

    try:
        snapshot_download(
            item.source.repo,
            revision=item.revision,
            local_dir=str(item.entry),
            token=token,
            allow_patterns=HF_PATTERNS,
        )
    except Exception as e:
        raise classify_hf(e, item.field, item.source) from e
    progress(item.size)


# --------------------------------------------------------------------------------------------- fetch


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """One fetcher per source at a time on a shared cache (two jobs starting together)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def fetch(
    sources: dict[str, str],
    cache_root: str,
    *,
    hf_token: str | None = None,
    report: Callable[[int, int, str], None] = lambda done, total, field: None,
) -> FetchSummary:
    """Fetch every remote source ({field: uri}) into `cache_root`; local paths pass through. `report` gets
    (bytes done, bytes total, field) as bytes arrive. Raises FetchError."""
    summary = FetchSummary()
    parsed = {name: parse_source(uri) for name, uri in sources.items()}
    client = s3_client() if any(s.scheme == "s3" for s in parsed.values()) else None
    todo: list[Resolved] = []
    for name, source in parsed.items():
        summary.paths[name] = local_model_path(source, cache_root)
        if not source.remote:
            continue
        item = (
            resolve_s3(client, name, source, cache_root)
            if source.scheme == "s3"
            else resolve_hf(name, source, cache_root, hf_token)
        )
        item.cached = entry_complete(item.entry, item.files)
        todo.append(item)
    summary.bytes_total = sum(i.size for i in todo if not i.cached)
    report(0, summary.bytes_total, "")
    for item in todo:
        with _locked(item.entry.parent / ".lock"):
            if not entry_complete(item.entry, item.files):  # another job may have finished it meanwhile
                _fetch_one(client, item, hf_token, summary, report)
            point_current(item.entry)
    return summary


def _fetch_one(
    client: Any,
    item: Resolved,
    token: str | None,
    summary: FetchSummary,
    report: Callable[[int, int, str], None],
) -> None:
    def progress(n: int) -> None:
        summary.bytes_fetched += n
        report(summary.bytes_fetched, summary.bytes_total, item.field)

    reset_entry(item.entry)
    if item.source.scheme == "s3":
        download_s3(client, item, progress)
    else:
        download_hf(item, token, progress)
    mark_complete(item.entry, item.files, item.source.uri, item.revision)


# ---------------------------------------------------------------------------------------------- main


class _Reporter:
    """Progress lines, at most one a second and the last one always, for the operator to read."""

    def __init__(self, out: Callable[[str], None]) -> None:
        self.out, self.last = out, 0.0

    def __call__(self, done: int, total: int, field: str) -> None:
        now = time.monotonic()
        if now - self.last >= 1.0 or done >= total:
            self.last = now
            self.out(FETCH_LOG_MARKER + json.dumps({"bytesDone": done, "bytesTotal": total, "model": field}))


def main(argv: list[str] | None = None) -> int:
    """The step: `--cache DIR --source FIELD=URI ...` (what the operator's init container runs), or the
    sources and cache of a spec (--spec-json/--spec-env/--spec-file). Exit 0 when every model is in the
    cache; 2 on a permanent failure (the operator fails the job); 1 otherwise (the pod retries)."""
    args = parser().parse_args(argv)
    say: Callable[[str], None] = lambda line: print(line, flush=True)  # noqa: E731
    try:
        cache, sources = what_to_fetch(args)
        token = os.environ.get("HF_TOKEN") or None
        summary = fetch(sources, cache, hf_token=token, report=_Reporter(say))
    except FetchError as e:
        _terminate(args.termination_log, termination_message(e.reason, e.field, e.message))
        say(f"error: {e.reason}: {e.message}")
        return INPUT_ERROR_EXIT_CODE if e.reason in PERMANENT_REASONS else 1
    except InputError as e:
        _terminate(args.termination_log, termination_message("FetchFailed", "storage", str(e)))
        say(f"error: {e}")
        return INPUT_ERROR_EXIT_CODE
    done = {"bytesFetched": summary.bytes_fetched, "bytesTotal": summary.bytes_total, "paths": summary.paths}
    say(FETCH_LOG_MARKER + json.dumps({**done, "done": True}))
    _terminate(args.termination_log, json.dumps(done))
    return 0


def parser() -> argparse.ArgumentParser:
    """The step's arguments (the operator's init container passes --cache and --source)."""
    p = argparse.ArgumentParser(prog="python -m rlhf_trainer.fetch_models", description=__doc__)
    p.add_argument("--cache", help="the model cache's mount path")
    p.add_argument("--source", action="append", default=[], metavar="FIELD=URI")
    p.add_argument("--spec-json")
    p.add_argument("--spec-env")
    p.add_argument("--spec-file")
    p.add_argument("--termination-log", default=TERMINATION_LOG)
    return p


def what_to_fetch(args: argparse.Namespace) -> tuple[str, dict[str, str]]:
    """The cache path and {field: uri} to fetch, from --cache/--source or from a spec."""
    if args.cache:
        pairs = [s.partition("=") for s in args.source]
        if any(not sep or not field for field, sep, _ in pairs):
            raise InputError("--source takes FIELD=URI, e.g. model.actor=hf://org/name")
        return args.cache, {field: uri for field, _, uri in pairs}
    spec = load_spec_arg(args)
    if spec.storage.model_cache is None:
        raise InputError("spec.storage.modelCache: needed by hf:// and s3:// model sources")
    return spec.storage.model_cache.mount_path, spec.model_sources()


def _terminate(path: str, message: str) -> None:
    with contextlib.suppress(OSError):  # outside a pod (no /dev/termination-log): the log line says it
        Path(path).write_text(message)


if __name__ == "__main__":
    sys.exit(main())
