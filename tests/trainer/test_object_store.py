"""The pure parts of rlhf_trainer.object_store: s3:// URLs, line splitting that agrees with a local file's
byte offsets, and what an S3 failure is reported as."""

from __future__ import annotations

from pathlib import Path

import pytest
from botocore.exceptions import ClientError, EndpointConnectionError, NoCredentialsError
from rlhf_trainer.object_store import ObjectStoreError, S3Url, describe_error, iter_lines, parse_s3_url

pytestmark = pytest.mark.unit


def test_an_s3_url_splits_into_bucket_and_key_and_a_prefix_has_children() -> None:
    url = parse_s3_url("s3://my-data.v2/math/train.parquet", "data.prompts")
    assert url == S3Url("my-data.v2", "math/train.parquet")
    assert str(url) == "s3://my-data.v2/math/train.parquet"
    assert str(parse_s3_url("s3://models/run-1/", "checkpoint.exportTo").child("_SUCCESS")) == (
        "s3://models/run-1/_SUCCESS"
    )


@pytest.mark.parametrize(
    ("url", "needle"),
    [
        ("/data/p.jsonl", "not an s3:// URL"),
        ("s3://Bucket/p.jsonl", "not an S3 bucket name"),
        ("s3://ab/p.jsonl", "not an S3 bucket name"),
        ("s3://bucket", "no object key"),
        ("s3://bucket//", "no object key"),
    ],
)
def test_a_malformed_s3_url_is_refused_naming_the_field(url: str, needle: str) -> None:
    with pytest.raises(ObjectStoreError, match=f"^data.eval.prompts {url}: .*{needle}"):
        parse_s3_url(url, "data.eval.prompts")


def test_lines_split_across_chunks_keep_a_local_files_byte_offsets(tmp_path: Path) -> None:
    """Only b"\\n" ends a line (a lone b"\\r" or b"\\x1c" does not), so the offsets indexed from the
    stream are those of the same file read locally."""
    data = b'{"a": 1}\r\n\n{"b": "x\\u2028"}\x1c \n{"c": 3}'
    local = (tmp_path / "f.jsonl").write_bytes(data)
    assert local == len(data)
    with (tmp_path / "f.jsonl").open("rb") as f:
        expected = list(f)
    for size in (1, 2, 5, 64):
        chunks = [data[i : i + size] for i in range(0, len(data), size)]
        assert list(iter_lines(chunks)) == expected, size


def _client_error(code: str) -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": "m"}}, "GetObject")


@pytest.mark.parametrize(
    ("error", "needle"),
    [
        (_client_error("404"), "no such object"),
        (_client_error("NoSuchKey"), "no such object"),
        (_client_error("NoSuchBucket"), "no such bucket"),
        (
            _client_error("InvalidAccessKeyId"),
            "access refused (InvalidAccessKeyId): check the keys in the Secret",
        ),
        (_client_error("403"), "access refused (403)"),
        (NoCredentialsError(), "no object-store credentials: set spec.storage.s3.credentialsSecret"),
        (EndpointConnectionError(endpoint_url="http://s3.local"), "cannot reach the object store"),
    ],
)
def test_an_s3_failure_says_what_it_means_naming_field_and_url(error: Exception, needle: str) -> None:
    message = describe_error(error, "data.prompts", "s3://bucket/p.jsonl")
    assert message.startswith("data.prompts s3://bucket/p.jsonl: ")
    assert needle in message
