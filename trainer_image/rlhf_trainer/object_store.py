"""s3:// objects for the trainer's datasets and exports: URL parsing, the client, what a failure means,
and a seekable read-only file over ranged GETs so a reader holds a buffer, never the object.

Credentials are boto3's standard variables (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL,
AWS_REGION), which the operator gives every pod from spec.storage.s3.credentialsSecret. No Ray, no torch.
"""

from __future__ import annotations

import io
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

SCHEME = "s3://"
# S3 bucket names: 3 to 63 lower-case letters, digits, dots and hyphens, starting and ending alphanumeric.
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


class ObjectStoreError(ValueError):
    """An s3:// source or destination that cannot be used; the message names the spec field."""


@dataclass(frozen=True)
class S3Url:
    """`s3://bucket/key` split; `key` is an object key, or a prefix for an export."""

    bucket: str
    key: str

    def __str__(self) -> str:
        return f"{SCHEME}{self.bucket}/{self.key}"

    def child(self, name: str) -> S3Url:
        """The object `name` under this URL taken as a prefix."""
        return S3Url(self.bucket, f"{self.key.rstrip('/')}/{name}" if self.key else name)


def is_s3(path: str) -> bool:
    return path.startswith(SCHEME)


def parse_s3_url(url: str, field: str) -> S3Url:
    """`s3://bucket/key` -> S3Url, or ObjectStoreError naming `field` (a key is required)."""
    if not is_s3(url):
        raise ObjectStoreError(f"{field} {url}: not an s3:// URL")
    bucket, _, key = url[len(SCHEME) :].partition("/")
    if not _BUCKET.match(bucket):
        raise ObjectStoreError(f"{field} {url}: {bucket!r} is not an S3 bucket name (3-63 of a-z 0-9 . -)")
    if not key.strip("/"):
        raise ObjectStoreError(f"{field} {url}: no object key after the bucket (s3://bucket/key)")
    return S3Url(bucket, key)


def iter_lines(chunks: Iterable[bytes]) -> Iterator[bytes]:
    """Chunks of a stream -> its lines, each with its b"\\n" (the last one may lack it): split on b"\\n"
    only, as iterating a file opened "rb" splits, so byte offsets agree with a local copy's."""
    pending = b""
    for chunk in chunks:
        pending += chunk
        start = 0
        while (end := pending.find(b"\n", start)) >= 0:
            yield pending[start : end + 1]
            start = end + 1
        pending = pending[start:]
    if pending:
        yield pending


def client() -> Any:
    """boto3's S3 client from the standard variables as they are now: a new session each time (boto3's
    default session keeps the first credentials it resolved)."""
    import boto3

    return boto3.session.Session().client("s3")


# botocore's errors for a store that did not answer: no connection, a timeout, a connection closed
# before the response, a response body cut off mid-read. Another attempt may well succeed.
_UNREACHABLE = frozenset(
    {"EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError", "ConnectionClosedError"}
)
_CUT_OFF = "ResponseStreamingError"
# The store's own failures and its throttling (S3's codes; a HEAD's error has only its HTTP status):
# the request was fine, the store could not serve it now.
_SERVER_CODES = frozenset(
    {
        "InternalError",
        "ServiceUnavailable",
        "SlowDown",
        "RequestTimeout",
        "Throttling",
        "ThrottlingException",
        "TooManyRequests",
        "RequestLimitExceeded",
        "BandwidthLimitExceeded",
        "500",
        "502",
        "503",
        "504",
        "429",
    }
)
_SERVER_STATUSES = frozenset({500, 502, 503, 504, 429})


def is_transient(error: BaseException) -> bool:
    """Whether an S3 failure is the store's, not the request's: an unreachable endpoint, a timeout, a
    connection closed or a read cut off, a 5xx or throttling answer. Another attempt may succeed; a
    missing object, refused or absent keys, a malformed URL cannot. Pure: reads the error's type name
    and response, imports nothing."""
    if type(error).__name__ in _UNREACHABLE or type(error).__name__ == _CUT_OFF:
        return True
    return error_code(error) in _SERVER_CODES or _http_status(error) in _SERVER_STATUSES


def describe_error(error: Exception, field: str, url: S3Url | str) -> str:
    """What an S3 failure means for the user, naming the field and the URL: a missing object or bucket,
    refused credentials, none at all, an unreachable endpoint, or the store's own failure (5xx,
    throttling)."""
    where = f"{field} {url}"
    code = error_code(error)
    if code in {"404", "NoSuchKey", "NotFound"}:
        return f"{where}: no such object"
    if code == "NoSuchBucket":
        return f"{where}: no such bucket"
    if code in {"403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "Forbidden"}:
        return (
            f"{where}: access refused ({code}): check the keys in the Secret named by "
            "spec.storage.s3.credentialsSecret"
        )
    name = type(error).__name__
    if name in {"NoCredentialsError", "PartialCredentialsError"}:
        return f"{where}: no object-store credentials: set spec.storage.s3.credentialsSecret ({error})"
    if name in _UNREACHABLE:
        return f"{where}: cannot reach the object store: {error}"
    if name == _CUT_OFF:
        return f"{where}: the object store's answer was cut off: {error}"
    if is_transient(error):
        return f"{where}: the object store answered {code or _http_status(error)}: try again later ({error})"
    return f"{where}: {error}"


def error_code(error: BaseException) -> str:
    """The S3 error code of a botocore ClientError ("NoSuchKey", "403", ...); "" for any other error."""
    response = getattr(error, "response", None)
    if isinstance(response, dict):
        return str(response.get("Error", {}).get("Code", ""))
    return ""


def _http_status(error: BaseException) -> int:
    response = getattr(error, "response", None)
    if isinstance(response, dict):
        try:
            return int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        except (TypeError, ValueError):
            return 0
    return 0


class S3RangeReader(io.RawIOBase):
    """A read-only, seekable file over one object: each read is one ranged GET of the bytes asked for.
    Wrap it in io.BufferedReader to read lines; pyarrow reads Parquet footers and column chunks from it
    directly. Opening checks the object exists (HEAD) and fixes its size and ETag: a read of an object
    replaced since fails (If-Match) rather than mixing two versions."""

    def __init__(self, s3: Any, url: S3Url, head: tuple[int, str] | None = None) -> None:
        super().__init__()
        self._s3 = s3
        self.url = url
        if head is None:
            found = s3.head_object(Bucket=url.bucket, Key=url.key)
            head = (int(found["ContentLength"]), str(found["ETag"]))
        self.size, self.etag = head
        self._pos = 0
        self.requests = 0  # GETs made
        self.bytes_read = 0  # by ranged GETs (tests check a reader fetches what it reads, not the object)

    def reopen(self) -> S3RangeReader:
        """Another reader of the same version of the object, without a HEAD."""
        return S3RangeReader(self._s3, self.url, (self.size, self.etag))

    def stream(self) -> Iterator[bytes]:
        """The whole object as one streamed GET, in chunks of 1 MiB (for a single pass, such as indexing)."""
        body = self._s3.get_object(Bucket=self.url.bucket, Key=self.url.key, IfMatch=self.etag)["Body"]
        self.requests += 1
        yield from body.iter_chunks(1 << 20)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.size}[whence]
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset}")
        self._pos = base + offset
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        n = min(len(view), self.size - self._pos)
        if n <= 0:
            return 0
        end = self._pos + n - 1
        response = self._s3.get_object(
            Bucket=self.url.bucket, Key=self.url.key, Range=f"bytes={self._pos}-{end}", IfMatch=self.etag
        )
        self.requests += 1
        got = 0
        for chunk in response["Body"].iter_chunks(1 << 20):
            view[got : got + len(chunk)] = chunk
            got += len(chunk)
        self._pos += got
        self.bytes_read += got
        return got
