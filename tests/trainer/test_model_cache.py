"""The model cache's completeness rule (marker written last, every listed file at its size), the reset of
a half-written entry, the `current` link, and how the fetcher classifies the stores' failures.

The Hub cannot be reached here: its answers are built as the Hub sends them (status and X-Error-Code)
and raised by huggingface_hub's own `hf_raise_for_status`, so the classes are the library's."""

from __future__ import annotations

import json
from pathlib import Path

import httpx2
import pytest
from botocore.exceptions import ClientError, NoCredentialsError
from huggingface_hub.utils import hf_raise_for_status
from rlhf_api.model_source import COMPLETE_MARKER, parse_source
from rlhf_trainer.fetch_models import classify_hf, classify_s3
from rlhf_trainer.model_cache import (
    RemoteFile,
    entry_complete,
    mark_complete,
    point_current,
    reset_entry,
    safe_name,
    termination_message,
)

pytestmark = pytest.mark.unit

FILES = [RemoteFile("config.json", 3), RemoteFile("model.safetensors", 5)]


def _write(entry: Path) -> None:
    entry.mkdir(parents=True, exist_ok=True)
    (entry / "config.json").write_bytes(b"abc")
    (entry / "model.safetensors").write_bytes(b"12345")


def test_an_entry_is_complete_only_with_its_marker(tmp_path: Path) -> None:
    entry = tmp_path / "rev"
    _write(entry)
    assert not entry_complete(entry, FILES)  # every file there, but no marker: a fetch was killed
    mark_complete(entry, FILES, "s3://b/m", "rev")
    assert entry_complete(entry, FILES)
    assert json.loads((entry / COMPLETE_MARKER).read_text())["files"] == {
        "config.json": 3,
        "model.safetensors": 5,
    }


def test_a_truncated_or_missing_file_makes_the_entry_incomplete(tmp_path: Path) -> None:
    entry = tmp_path / "rev"
    _write(entry)
    mark_complete(entry, FILES, "s3://b/m", "rev")
    (entry / "model.safetensors").write_bytes(b"12")
    assert not entry_complete(entry, FILES)
    (entry / "model.safetensors").unlink()
    assert not entry_complete(entry)


def test_a_marker_for_other_files_does_not_count(tmp_path: Path) -> None:
    entry = tmp_path / "rev"
    _write(entry)
    mark_complete(entry, FILES[:1], "s3://b/m", "rev")
    assert not entry_complete(entry, FILES)


def test_reset_removes_what_a_killed_fetch_left(tmp_path: Path) -> None:
    entry = tmp_path / "rev"
    _write(entry)
    reset_entry(entry)
    assert entry.is_dir() and not any(entry.iterdir())


def test_current_points_at_the_entry_and_moves_atomically(tmp_path: Path) -> None:
    first, second = tmp_path / "src" / "r1", tmp_path / "src" / "r2"
    first.mkdir(parents=True)
    second.mkdir()
    assert point_current(first).resolve() == first.resolve()
    assert point_current(second).resolve() == second.resolve()
    assert sorted(p.name for p in (tmp_path / "src").iterdir()) == ["current", "r1", "r2"]


@pytest.mark.parametrize("name", ["../x", "/etc/passwd", "a/../../b", ""])
def test_object_names_cannot_escape_the_entry(name: str) -> None:
    with pytest.raises(ValueError, match="outside the cache entry"):
        safe_name(name)


def _s3_error(code: str, status: int) -> ClientError:
    return ClientError(
        {"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "ListObjectsV2"
    )


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (_s3_error("NoSuchBucket", 404), "ModelNotFound"),
        (_s3_error("404", 404), "ModelNotFound"),
        (_s3_error("InvalidAccessKeyId", 403), "CredentialsRefused"),
        (_s3_error("SignatureDoesNotMatch", 403), "CredentialsRefused"),
        (_s3_error("AccessDenied", 403), "CredentialsRefused"),
        (NoCredentialsError(), "CredentialsRefused"),
        (_s3_error("SlowDown", 503), "FetchFailed"),
    ],
)
def test_s3_failures_are_classified(error: Exception, reason: str) -> None:
    failure = classify_s3(error, "model.actor", parse_source("s3://bkt/actor"))
    assert failure.reason == reason
    assert failure.message.startswith("spec.model.actor: s3://bkt/actor")


def _hub_error(status: int, code: str | None, url: str, message: str | None = None) -> Exception:
    headers = {"X-Error-Code": code} if code else {}
    if message:
        headers["X-Error-Message"] = message
    response = httpx2.Response(status, headers=headers, request=httpx2.Request("GET", url))
    with pytest.raises(Exception) as raised:
        hf_raise_for_status(response)
    return raised.value


API = "https://huggingface.co/api/models/org/name"


@pytest.mark.parametrize(
    ("status", "code", "url", "message", "reason"),
    [
        (404, "RepoNotFound", API, None, "ModelNotFound"),
        (401, None, API, None, "ModelNotFound"),  # private or missing: the Hub answers both alike
        (404, "RevisionNotFound", API + "/revision/nope", None, "RevisionNotFound"),
        (403, "GatedRepo", API, None, "CredentialsRefused"),
        (401, None, API, "Invalid credentials in Authorization header", "CredentialsRefused"),
        (403, None, API, "no access", "CredentialsRefused"),
        (500, None, API, None, "FetchFailed"),
    ],
)
def test_hub_failures_are_classified(
    status: int, code: str | None, url: str, message: str | None, reason: str
) -> None:
    source = parse_source("hf://org/name@nope")
    failure = classify_hf(_hub_error(status, code, url, message), "model.actor", source)
    assert failure.reason == reason
    assert failure.message.startswith("spec.model.actor: hf://org/name@nope")


def test_termination_message_carries_reason_and_field() -> None:
    body = json.loads(termination_message("ModelNotFound", "model.actor", "spec.model.actor: gone"))
    assert body == {"reason": "ModelNotFound", "field": "model.actor", "message": "spec.model.actor: gone"}


def test_the_trainer_loads_remote_models_from_their_cache_paths() -> None:
    """config.localized: the trainer's paths are the fetcher's (one rule, model_source.local_model_path)."""
    from rlhf_api.model_source import local_model_path
    from rlhf_api.spec import RLHFJobSpec
    from rlhf_trainer.config import localized
    from testkit.support import minimal_job

    job = minimal_job("x")["spec"]
    job["model"] = {
        "actor": "hf://org/actor@v2",
        "reference": "/models/ref",
        "reward": {"type": "model", "model": "s3://bkt/rm"},
    }
    job["algorithm"] = {"klCoef": 0.01}
    job["storage"] = {
        "s3": {"credentialsSecret": "s3"},
        "modelCache": {"claimName": "cache", "mountPath": "/mc"},
    }
    spec = localized(RLHFJobSpec.model_validate(job))
    assert spec.model.actor == local_model_path(parse_source("hf://org/actor@v2"), "/mc")
    assert spec.model.actor.startswith("/mc/hf/")
    assert spec.model.reward.model == local_model_path(parse_source("s3://bkt/rm"), "/mc")
    assert (spec.model.reference, spec.model.critic) == ("/models/ref", None)  # a path passes through


def test_the_operators_init_container_command_is_the_fetchers() -> None:
    """The command rlhf_operator.manifests writes parses with the fetcher's own parser into the job's
    remote sources and cache path; the same spec given to the command yields the same."""
    from rlhf_api.spec import RLHFJob
    from rlhf_operator import manifests
    from rlhf_trainer.fetch_models import parser, what_to_fetch
    from testkit.support import minimal_job

    doc = minimal_job("x")
    doc["spec"]["model"]["actor"] = "hf://org/actor@v1"
    doc["spec"]["storage"] = {"modelCache": {"claimName": "cache", "mountPath": "/mc"}}
    fetch = manifests.build_raycluster(RLHFJob.model_validate(doc))["spec"]["headGroupSpec"]["template"]
    command = fetch["spec"]["initContainers"][0]["command"]
    assert command[:3] == ["python", "-m", "rlhf_trainer.fetch_models"]
    expected = ("/mc", {"model.actor": "hf://org/actor@v1"})
    assert what_to_fetch(parser().parse_args(command[3:])) == expected
    assert what_to_fetch(parser().parse_args(["--spec-json", json.dumps(doc["spec"])])) == expected
