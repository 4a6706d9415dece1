"""Model sources: the three forms a model field accepts, the pattern that refuses the rest (the CRD's and
pydantic's), and the one local path each source is loaded from."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from rlhf_api.model_source import entry_dir, local_model_path, parse_source, s3_revision_key, source_key
from rlhf_api.spec import RLHFJobSpec
from testkit.support import minimal_job

pytestmark = pytest.mark.unit


def test_hf_source_with_and_without_revision() -> None:
    pinned = parse_source("hf://HuggingFaceTB/SmolLM2-135M@v1.0")
    assert (pinned.scheme, pinned.repo, pinned.revision) == ("hf", "HuggingFaceTB/SmolLM2-135M", "v1.0")
    assert parse_source("hf://org/name").revision is None  # main, resolved to a commit by the fetcher
    commit = parse_source("hf://org/name@0123456789abcdef0123456789abcdef01234567")
    assert commit.revision == "0123456789abcdef0123456789abcdef01234567"
    assert parse_source("hf://org/name@refs/pr/1").revision == "refs/pr/1"


def test_s3_and_path_sources() -> None:
    s3 = parse_source("s3://models-bucket/team/actor/")
    assert (s3.scheme, s3.bucket, s3.prefix) == ("s3", "models-bucket", "team/actor")
    assert parse_source("s3://models-bucket").prefix == ""
    local = parse_source("/models/actor")
    assert (local.scheme, local.path, local.remote) == ("path", "/models/actor", False)
    assert parse_source("models/actor").scheme == "path"


@pytest.mark.parametrize(
    "uri",
    [
        "gs://bucket/model",
        "hf://just-a-name",
        "hf://org/name@",
        "s3://",
        "s3://UPPER/x",
        "https://x/y",
        "c:x",
    ],
)
def test_unknown_or_malformed_sources_are_refused(uri: str) -> None:
    with pytest.raises(ValueError, match="hf://org/name"):
        parse_source(uri)


def test_the_spec_refuses_a_bad_source_naming_the_field() -> None:
    job = minimal_job("x")["spec"]
    job["model"]["actor"] = "gs://bucket/model"
    with pytest.raises(ValidationError) as err:
        RLHFJobSpec.model_validate(job)
    assert [e["loc"] for e in err.value.errors()] == [("model", "actor")]


def test_local_path_is_the_path_and_remote_sources_load_from_the_cache() -> None:
    assert local_model_path(parse_source("/models/actor"), "/cache") == "/models/actor"
    hf = parse_source("hf://org/name@v1")
    path = local_model_path(hf, "/cache")
    assert path.startswith("/cache/hf/org_name_v1-") and path.endswith("/current")
    # the revision is part of the key: another revision is another entry, never the same directory
    assert local_model_path(parse_source("hf://org/name@v2"), "/cache") != path
    assert entry_dir(hf, "/cache", "abc") == path.removesuffix("current") + "abc"


def test_source_keys_are_distinct_for_look_alike_uris() -> None:
    # the slug maps both to org_name_x; the hash keeps them apart
    assert source_key(parse_source("s3://bkt/org/name_x")) != source_key(parse_source("s3://bkt/org/name/x"))


def test_s3_revision_follows_the_etags_not_the_order() -> None:
    listing = [("config.json", '"e1"', 10), ("model.safetensors", '"e2"', 99)]
    assert s3_revision_key(listing) == s3_revision_key(list(reversed(listing)))
    changed = [("config.json", '"e1"', 10), ("model.safetensors", '"e3"', 99)]
    assert s3_revision_key(changed) != s3_revision_key(listing)


def test_model_sources_name_the_fields_of_the_loaded_roles() -> None:
    job = minimal_job("x")["spec"]
    job["model"] = {
        "actor": "hf://org/actor",
        "critic": "s3://bkt/critic",
        "reward": {"type": "model", "model": "/models/rm"},
    }
    job["algorithm"] = {"advantageEstimator": "gae", "klCoef": 0.0}
    spec = RLHFJobSpec.model_validate(job)
    assert spec.model_sources() == {
        "model.actor": "hf://org/actor",
        "model.critic": "s3://bkt/critic",
        "model.reward.model": "/models/rm",
    }
