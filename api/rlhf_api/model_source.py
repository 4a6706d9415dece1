"""Where a model comes from: a directory on a mounted volume, `hf://org/name[@revision]` or
`s3://bucket/prefix`, and the one local path each fetched source is loaded from (shared by the fetcher,
the operator and the trainer, so they never disagree). Pure: standard library only, no I/O.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Final, Literal

# One pattern for the spec's model fields (the CRD's OpenAPI pattern and pydantic's): a Hub repository
# with an optional revision, an S3 bucket with an optional prefix, an absolute path, or a relative path
# without a colon (so an unknown scheme such as gs:// is refused at admission, naming the field).
HF_PATTERN: Final = (
    r"hf://[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*(@[A-Za-z0-9][A-Za-z0-9._/-]*)?"
)
S3_PATTERN: Final = r"s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/[^\s]*)?"
MODEL_SOURCE_PATTERN: Final = rf"^({HF_PATTERN}|{S3_PATTERN}|/\S*|[^:\s][^:]*)$"
# Bounded so that the admission rules' regular expressions over these fields have a small CEL cost.
MODEL_SOURCE_MAX_LENGTH: Final = 1024
MODEL_SOURCE_HELP: Final = (
    "an HF-format directory on a mounted volume (see pods.volumes), `hf://org/name[@revision]` (the "
    "Hugging Face Hub; revision a branch, tag or commit, default main) or `s3://bucket/prefix` (an "
    "S3-compatible store, credentials from storage.s3.credentialsSecret); remote sources are fetched once "
    "into storage.modelCache before the trainer starts (docs/models.md)"
)
# The init container of the head pod that fetches the models, and the prefix of its progress lines
# (`RLHF_FETCH {"bytesDone": ..., "bytesTotal": ...}`), which the operator reads into ModelsReady.
FETCH_CONTAINER: Final = "fetch-models"
FETCH_LOG_MARKER: Final = "RLHF_FETCH "
# Written last into a cache entry: an entry without it is incomplete and is fetched again.
COMPLETE_MARKER: Final = ".rlhf-complete.json"

Scheme = Literal["path", "hf", "s3"]


@dataclass(frozen=True)
class ModelSource:
    """A parsed model field. For `hf`: `repo` and `revision` (None: main); for `s3`: `bucket` and
    `prefix` (no trailing slash); for `path`: `path`."""

    uri: str
    scheme: Scheme
    repo: str = ""
    revision: str | None = None
    bucket: str = ""
    prefix: str = ""
    path: str = ""

    @property
    def remote(self) -> bool:
        """Whether the source must be fetched into the cache (a path is loaded where it is)."""
        return self.scheme != "path"


def parse_source(uri: str) -> ModelSource:
    """The source a model field names; ValueError when it matches none of the three forms."""
    if not re.fullmatch(MODEL_SOURCE_PATTERN, uri):
        raise ValueError(f"{uri!r} is not {MODEL_SOURCE_HELP}")
    if uri.startswith("hf://"):
        repo, _, revision = uri[len("hf://") :].partition("@")
        return ModelSource(uri, "hf", repo=repo, revision=revision or None)
    if uri.startswith("s3://"):
        bucket, _, prefix = uri[len("s3://") :].partition("/")
        return ModelSource(uri, "s3", bucket=bucket, prefix=prefix.strip("/"))
    return ModelSource(uri, "path", path=uri)


def source_key(source: ModelSource) -> str:
    """A directory name for the source, readable and collision-free: a slug of the URI (revision
    included) and a short hash of it."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", source.uri.split("://", 1)[-1]).strip("_")[:80]
    digest = hashlib.sha256(source.uri.encode()).hexdigest()[:12]
    return f"{slug}-{digest}"


def local_model_path(source: ModelSource, cache_root: str) -> str:
    """Where the trainer loads the model from: the path itself, or for a remote source
    `<cache>/<scheme>/<key>/current`, a link the fetcher points at the complete revision entry."""
    if not source.remote:
        return source.path
    return str(PurePosixPath(cache_root) / source.scheme / source_key(source) / "current")


def entry_dir(source: ModelSource, cache_root: str, revision_key: str) -> str:
    """The cache entry of one revision of a source (a Hub commit, or a hash of an S3 listing's ETags)."""
    return str(PurePosixPath(cache_root) / source.scheme / source_key(source) / revision_key)


def s3_revision_key(listing: list[tuple[str, str, int]]) -> str:
    """The revision of an S3 prefix: a hash of its objects' (relative key, ETag, size), order-free, so
    a changed object is a new entry and an unchanged prefix finds the complete one."""
    text = "\n".join(f"{key}\t{etag.strip(chr(34))}\t{size}" for key, etag, size in sorted(listing))
    return "s3-" + hashlib.sha256(text.encode()).hexdigest()[:16]
