"""The model cache's rules: an entry is complete only when its marker (written last) lists every file
at its size; an incomplete entry is removed and fetched again; `current` points at the complete entry.
And the failure classes a fetch ends in. No network: the fetcher (fetch_models.py) does the transfers.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal

from rlhf_api.model_source import COMPLETE_MARKER

FailureReason = Literal["ModelNotFound", "RevisionNotFound", "CredentialsRefused", "FetchFailed"]
# The reasons no retry can fix: the operator fails the job at once on them (docs/models.md).
PERMANENT_REASONS: Final = frozenset({"ModelNotFound", "RevisionNotFound", "CredentialsRefused"})


class FetchError(Exception):
    """A fetch that failed, classified: `field` is the spec field (e.g. `model.actor`)."""

    def __init__(self, reason: FailureReason, field: str, message: str) -> None:
        super().__init__(f"spec.{field}: {message}")
        self.reason: FailureReason = reason
        self.field = field
        self.message = f"spec.{field}: {message}"


@dataclass(frozen=True)
class RemoteFile:
    """One file of a revision: its path inside the model directory, its size and where to get it."""

    name: str
    size: int
    key: str = ""  # the S3 object key (the Hub downloads by name)


def entry_complete(entry: Path, files: list[RemoteFile] | None = None) -> bool:
    """Whether `entry` holds a whole revision: its marker exists and every file it lists is there at its
    size (and, given `files`, the marker lists exactly those). Anything less is a half-written entry."""
    try:
        listed = json.loads((entry / COMPLETE_MARKER).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    if files is not None and sorted(listed.items()) != sorted((f.name, f.size) for f in files):
        return False
    for name, size in listed.items():
        path = entry / name
        if not path.is_file() or path.stat().st_size != size:
            return False
    return True


def reset_entry(entry: Path) -> None:
    """An incomplete entry is redone from nothing: remove whatever a killed fetch left."""
    if entry.exists() or entry.is_symlink():
        shutil.rmtree(entry, ignore_errors=True)
    entry.mkdir(parents=True, exist_ok=True)


def mark_complete(entry: Path, files: list[RemoteFile], source: str, revision: str) -> None:
    """Write the marker, last, after every file is in place (through a rename, so it is whole or absent)."""
    body = {"source": source, "revision": revision, "files": {f.name: f.size for f in files}}
    tmp = entry / (COMPLETE_MARKER + ".tmp")
    tmp.write_text(json.dumps(body, indent=1, sort_keys=True))
    os.replace(tmp, entry / COMPLETE_MARKER)


def point_current(entry: Path) -> Path:
    """Point `<source>/current` (the trainer's load path) at `entry`, atomically (a new link renamed over
    the old one), so a reader sees the previous complete revision or this one, never a mix."""
    link = entry.parent / "current"
    tmp = entry.parent / f".current.{os.getpid()}"
    if tmp.is_symlink():
        tmp.unlink()
    tmp.symlink_to(entry.name)
    os.replace(tmp, link)
    return link


def safe_name(name: str) -> str:
    """A file name inside the entry; refuses names that would escape it (`..`, absolute)."""
    parts = Path(name).parts
    if not name or Path(name).is_absolute() or ".." in parts:
        raise ValueError(f"refusing object name {name!r}: it would be written outside the cache entry")
    return name


def termination_message(reason: FailureReason, field: str, message: str) -> str:
    """The fetch container's termination message on failure, read by the operator (status/ModelsReady)."""
    return json.dumps({"reason": reason, "field": field, "message": message[:3000]})
