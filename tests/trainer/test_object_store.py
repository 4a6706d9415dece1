"""The pure parts of rlhf_trainer.object_store: s3:// URLs, line splitting that agrees with a local file's
byte offsets, what an S3 failure is reported as, and whether it is the store's (transient) or the
request's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from botocore.exceptions import (
    ClientError,
    ConnectionClosedError,
    ConnectTimeoutError,
    EndpointConnectionError,
    NoCredentialsError,
    PartialCredentialsError,
    ReadTimeoutError,
    ResponseStreamingError,
    SSLError,
)
from rlhf_trainer.object_store import (
    ObjectStoreError,
    S3Url,
    describe_error,
    is_transient,
    iter_lines,
    parse_s3_url,
)

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


def _client_error(code: str, status: int | None = None) -> ClientError:
    response: dict[str, Any] = {"Error": {"Code": code, "Message": "m"}}
    if status is not None:
        response["ResponseMetadata"] = {"HTTPStatusCode": status}
    return ClientError(response, "GetObject")


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
        (_client_error("SlowDown", 503), "the object store answered SlowDown: try again later"),
        (_client_error("503", 503), "the object store answered 503: try again later"),
        (_client_error("", 500), "the object store answered 500: try again later"),
        (ReadTimeoutError(endpoint_url="http://s3.local"), "cannot reach the object store"),
        (ResponseStreamingError(error="IncompleteRead"), "the object store's answer was cut off"),
    ],
)
def test_an_s3_failure_says_what_it_means_naming_field_and_url(error: Exception, needle: str) -> None:
    message = describe_error(error, "data.prompts", "s3://bucket/p.jsonl")
    assert message.startswith("data.prompts s3://bucket/p.jsonl: ")
    assert needle in message


_TRANSIENT = [
    EndpointConnectionError(endpoint_url="http://s3.local"),
    ConnectTimeoutError(endpoint_url="http://s3.local"),
    ReadTimeoutError(endpoint_url="http://s3.local"),
    ConnectionClosedError(endpoint_url="http://s3.local"),
    ResponseStreamingError(error="IncompleteRead"),
    _client_error("InternalError", 500),
    _client_error("ServiceUnavailable", 503),
    _client_error("SlowDown", 503),
    _client_error("503"),  # a HEAD's error: no body, the status as its code
    _client_error("500"),
    _client_error("Throttling", 400),
    _client_error("ThrottlingException"),
    _client_error("RequestTimeout", 400),
    _client_error("", 502),
    _client_error("", 504),
    _client_error("", 429),
]
_PERMANENT = [
    _client_error("404", 404),
    _client_error("NoSuchKey", 404),
    _client_error("NoSuchBucket", 404),
    _client_error("403", 403),
    _client_error("AccessDenied", 403),
    _client_error("InvalidAccessKeyId", 403),
    _client_error("SignatureDoesNotMatch", 403),
    _client_error("PreconditionFailed", 412),  # the object replaced since it was opened
    _client_error("NotImplemented", 501),
    NoCredentialsError(),
    PartialCredentialsError(provider="env", cred_var="AWS_SECRET_ACCESS_KEY"),
    SSLError(endpoint_url="http://s3.local", error="certificate verify failed"),
    ObjectStoreError("data.prompts s3://b/p.jsonl: not an S3 bucket name"),
    ValueError("x"),
]


@pytest.mark.parametrize("error", _TRANSIENT, ids=lambda e: f"{type(e).__name__}:{_code_of(e)}")
def test_the_stores_own_failures_are_transient(error: Exception) -> None:
    """Unreachable, timed out, cut off, a 5xx or throttling: another attempt may succeed."""
    assert is_transient(error)


@pytest.mark.parametrize("error", _PERMANENT, ids=lambda e: f"{type(e).__name__}:{_code_of(e)}")
def test_the_requests_failures_are_not_transient(error: Exception) -> None:
    """A missing object or bucket, refused or absent keys, a bad certificate, a malformed URL: another
    attempt meets the same failure."""
    assert not is_transient(error)


def _code_of(error: Exception) -> str:
    response = getattr(error, "response", None)
    if not isinstance(response, dict):
        return ""
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode", "")
    return f"{response['Error']['Code']}/{status}"
