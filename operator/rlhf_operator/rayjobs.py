"""Ray Jobs REST client: submit the trainer entrypoint to a RayCluster's head and follow it.

Owns only HTTP to the Ray dashboard (`/api/jobs/`). Submission ids are chosen by the caller and
deterministic, so a retried submit after an operator crash finds the job instead of starting a second one.
"""

from __future__ import annotations

import functools
import os
import secrets
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

# Ray's JobStatus values.
PENDING, RUNNING, STOPPED, SUCCEEDED, FAILED = "PENDING", "RUNNING", "STOPPED", "SUCCEEDED", "FAILED"
TERMINAL = frozenset({STOPPED, SUCCEEDED, FAILED})


class RayJobsError(RuntimeError):
    """The dashboard could not be reached or refused a request; the message says which and why."""


@dataclass(frozen=True)
class RayJobInfo:
    submission_id: str
    status: str
    message: str
    start_time: float | None
    end_time: float | None
    driver_exit_code: int | None = None  # the entrypoint's exit status, once it has exited

    @classmethod
    def from_api(cls, data: dict[str, Any]) -> RayJobInfo:
        def secs(ms: Any) -> float | None:
            return float(ms) / 1000.0 if ms else None

        return cls(
            submission_id=str(data.get("submission_id") or data.get("job_id") or ""),
            status=str(data.get("status", PENDING)),
            message=str(data.get("message") or ""),
            start_time=secs(data.get("start_time")),
            end_time=secs(data.get("end_time")),
            driver_exit_code=code if isinstance(code := data.get("driver_exit_code"), int) else None,
        )


@functools.cache
def tls_context() -> ssl.SSLContext:
    """httpx's default TLS context, built once per process. Building it loads the CA bundle, about 30 ms
    of CPU, and a client per request did that on every reconcile and scrape: with 100 jobs that was more
    than the operator's whole CPU (benchmarks/operator_scale.py)."""
    return httpx.create_ssl_context()


def kept_connection(keepalive: float) -> httpx.Limits:
    """One idle connection kept per client (a job's calls to its head come one at a time), for `keepalive` s."""
    return httpx.Limits(max_keepalive_connections=1, keepalive_expiry=keepalive)


TOKEN_KEY_ENV = "RLHF_RAY_TOKEN_KEY_FILE"


@functools.cache
def token_key() -> bytes:
    """The operator's key for the jobs' Ray tokens (security.job_token).

    The file named by RLHF_RAY_TOKEN_KEY_FILE (the chart mounts a Secret there), which must exist and hold
    at least 32 bytes; unset (a development run on a workstation), a key of this user's kept in
    ~/.cache/rlhf-operator/ray-token-key, made on first use, so restarts keep every job's token.
    """
    configured = os.environ.get(TOKEN_KEY_ENV, "")
    path = Path(configured) if configured else _default_key_path()
    if not configured and not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:  # another operator process on this machine made it first
            pass
        else:
            with os.fdopen(fd, "wb") as f:
                # Text, not raw bytes: the key is read stripped, and 32 random bytes begin or end with a
                # whitespace byte about one time in twenty (a unit test failed that way).
                f.write(secrets.token_hex(32).encode())
    try:
        key = path.read_bytes().strip()
    except OSError as e:
        raise RayJobsError(f"reading the Ray token key ({TOKEN_KEY_ENV}={path}): {e}") from e
    if len(key) < 32:
        raise RayJobsError(f"the Ray token key in {path} is {len(key)} bytes; it needs at least 32")
    return key


def _default_key_path() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "rlhf-operator" / "ray-token-key"


class RayJobsClient:
    """A small synchronous client; the operator calls it from kopf's handler threads."""

    def __init__(
        self, dashboard_url: str, timeout: float = 10.0, token: str | None = None, keepalive: float = 5.0
    ) -> None:
        """`keepalive`: seconds an idle connection is kept for the next call (one connection per client)."""
        self.base = dashboard_url.rstrip("/")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(
            timeout=timeout, headers=headers, verify=tls_context(), limits=kept_connection(keepalive)
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> RayJobsClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _request(self, method: str, path: str, **kw: Any) -> httpx.Response:
        try:
            return self._http.request(method, f"{self.base}{path}", **kw)
        except httpx.HTTPError as e:
            raise RayJobsError(
                f"Ray dashboard at {self.base} unreachable: {e.__class__.__name__}: {e}"
            ) from e

    def get(self, submission_id: str) -> RayJobInfo | None:
        resp = self._request("GET", f"/api/jobs/{submission_id}")
        if resp.status_code == 404:
            return None
        if resp.status_code != 200:
            raise RayJobsError(f"GET job {submission_id}: HTTP {resp.status_code}: {resp.text[:300]}")
        return RayJobInfo.from_api(resp.json())

    def submit(
        self,
        submission_id: str,
        entrypoint: str,
        runtime_env: dict[str, Any] | None = None,
        metadata: dict[str, str] | None = None,
        entrypoint_num_cpus: float | None = None,
    ) -> RayJobInfo:
        """Submit, or return the existing job if this submission id was already used (idempotent)."""
        existing = self.get(submission_id)
        if existing is not None:
            return existing
        body: dict[str, Any] = {
            "entrypoint": entrypoint,
            "submission_id": submission_id,
            "runtime_env": runtime_env or {},
            "metadata": metadata or {},
        }
        if entrypoint_num_cpus is not None:
            body["entrypoint_num_cpus"] = entrypoint_num_cpus
        resp = self._request("POST", "/api/jobs/", json=body)
        if resp.status_code in (200, 201):
            info = self.get(submission_id)
            return info or RayJobInfo(submission_id, PENDING, "", None, None)
        # A concurrent submit of the same id (operator restarted mid-request) shows up as a 400/409 here.
        info = self.get(submission_id)
        if info is not None:
            return info
        raise RayJobsError(f"submit {submission_id}: HTTP {resp.status_code}: {resp.text[:500]}")

    def logs(self, submission_id: str) -> str:
        """The job's driver log (the entrypoint's output); '' for an unknown job."""
        resp = self._request("GET", f"/api/jobs/{submission_id}/logs")
        if resp.status_code == 404:
            return ""
        if resp.status_code != 200:
            raise RayJobsError(f"GET logs of {submission_id}: HTTP {resp.status_code}: {resp.text[:300]}")
        return str(resp.json().get("logs") or "")

    def stop(self, submission_id: str) -> bool:
        resp = self._request("POST", f"/api/jobs/{submission_id}/stop")
        if resp.status_code == 404:
            return False
        if resp.status_code != 200:
            raise RayJobsError(f"stop {submission_id}: HTTP {resp.status_code}: {resp.text[:300]}")
        return bool(resp.json().get("stopped", False))
