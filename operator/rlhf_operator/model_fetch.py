"""The fetch step as the operator sees it: the head pod's `fetch-models` init container (its state, the
last progress line of its log, its termination message) read into the ModelsReady condition, or into a
permanent failure that fails the job. Pure: the handler reads the pods and the log tail.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from rlhf_api.constants import INPUT_ERROR_EXIT_CODE
from rlhf_api.model_source import FETCH_CONTAINER, FETCH_LOG_MARKER

# The fetcher's reasons no retry can fix (rlhf_trainer.model_cache.PERMANENT_REASONS, exit status 2).
PERMANENT_REASONS = frozenset({"ModelNotFound", "RevisionNotFound", "CredentialsRefused"})
FetchPhase = Literal["waiting", "fetching", "done", "failed"]


@dataclass(frozen=True)
class FetchState:
    """Where the fetch step is. `permanent`: a failure the job cannot recover from (fail it now)."""

    phase: FetchPhase
    bytes_done: int = 0
    bytes_total: int = 0
    reason: str = ""
    message: str = ""
    permanent: bool = False


def _head(pods: list[dict[str, Any]]) -> dict[str, Any] | None:
    heads = [p for p in pods if (p.get("metadata", {}).get("labels") or {}).get("ray.io/node-type") == "head"]
    return heads[0] if heads else None


def _fetch_status(pod: dict[str, Any] | None) -> dict[str, Any] | None:
    statuses = ((pod or {}).get("status") or {}).get("initContainerStatuses") or []
    return next((s for s in statuses if s.get("name") == FETCH_CONTAINER), None)


def fetching_pod(pods: list[dict[str, Any]]) -> str | None:
    """The head pod whose fetch step is running now (its log carries the progress), if any."""
    head = _head(pods)
    status = _fetch_status(head)
    if head is None or status is None or "running" not in (status.get("state") or {}):
        return None
    return str(head["metadata"]["name"])


def last_progress(log: str | None) -> tuple[int, int] | None:
    """(bytes done, bytes total) from the last progress line of the fetch step's log."""
    for line in reversed((log or "").splitlines()):
        if line.startswith(FETCH_LOG_MARKER):
            try:
                body = json.loads(line[len(FETCH_LOG_MARKER) :])
                return int(body.get("bytesDone", body.get("bytesFetched", 0))), int(body.get("bytesTotal", 0))
            except (ValueError, TypeError, AttributeError):
                return None
    return None


def _terminated(status: dict[str, Any]) -> FetchState:
    """A finished fetch: done (exit 0), or failed with the reason of its termination message."""
    done = (status.get("state") or {}).get("terminated") or {}
    if done.get("exitCode") == 0:
        body = _json(done.get("message"))
        return FetchState("done", int(body.get("bytesFetched", 0)), int(body.get("bytesTotal", 0)))
    failed = done or (status.get("lastState") or {}).get("terminated") or {}
    body = _json(failed.get("message"))
    reason = str(body.get("reason") or "FetchFailed")
    message = str(body.get("message") or f"the fetch step exited with {failed.get('exitCode')}")
    permanent = failed.get("exitCode") == INPUT_ERROR_EXIT_CODE and reason in PERMANENT_REASONS
    return FetchState("failed", reason=reason, message=message, permanent=permanent)


def _json(text: Any) -> dict[str, Any]:
    try:
        body = json.loads(text or "{}")
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def fetch_state(pods: list[dict[str, Any]], log: str | None) -> FetchState | None:
    """The fetch step's state from the head pod (None: no head pod or no fetch step yet). A step that
    failed and was restarted by the kubelet reports its last failure (lastState) until it runs again."""
    status = _fetch_status(_head(pods))
    if status is None:
        return None
    state = status.get("state") or {}
    if "terminated" in state:
        return _terminated(status)
    if "running" in state:
        done, total = last_progress(log) or (0, 0)
        return FetchState("fetching", done, total)
    if (status.get("lastState") or {}).get("terminated"):
        return _terminated(status)  # waiting to be restarted (CrashLoopBackOff) after a failure
    return FetchState("waiting")


def models_condition(state: FetchState) -> tuple[bool, str, str]:
    """ModelsReady's (status, reason, message) for a fetch state that is not a permanent failure."""
    if state.phase == "done" and not state.bytes_total:
        return True, "ModelsCached", "every model was already in the cache (0 bytes fetched)"
    if state.phase == "done":
        return True, "ModelsFetched", f"models fetched into the cache ({state.bytes_done} bytes)"
    if state.phase == "fetching":
        return False, "Fetching", f"fetching models: {state.bytes_done} of {state.bytes_total} bytes"
    if state.phase == "failed":
        return False, state.reason, f"{state.message} (the pod retries the fetch)"
    return False, "FetchPending", "the fetch step has not started"
