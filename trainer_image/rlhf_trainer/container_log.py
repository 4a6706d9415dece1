"""Echoes the driver's log lines (device map, steps, errors) to the head container's own log, so
`kubectl logs` of the head pod shows them. Ray sends a job driver's output to the job's log file on the head, where a
Kubernetes user does not look. Best effort: outside a head pod, or when the stream cannot be opened,
it does nothing (the Ray job log keeps every line either way).
"""

from __future__ import annotations

import os
from typing import TextIO

from rlhf_api.constants import ROLE_ENV

# The container's first process holds the stream the runtime collects as the pod's log.
CONTAINER_STDOUT = "/proc/1/fd/1"

_stream: TextIO | None = None
_disabled = False


def _open(path: str, roles: tuple[str, ...]) -> TextIO | None:
    global _disabled
    if _disabled:
        return None
    if os.environ.get(ROLE_ENV) not in roles or os.getpid() == 1:
        _disabled = True
        return None
    try:
        return open(path, "a", buffering=1, encoding="utf-8")  # kept open for the run
    except OSError:
        _disabled = True
        return None


def echo(line: str, path: str = CONTAINER_STDOUT, roles: tuple[str, ...] = ("head",)) -> bool:
    """Writes one line to the container's log in a pod of one of `roles` (the head's by default: a
    rollout pod's hook names its own); True if it was written."""
    global _stream, _disabled
    if _stream is None:
        _stream = _open(path, roles)
        if _stream is None:
            return False
    try:
        _stream.write(line.rstrip("\n") + "\n")
        return True
    except OSError:
        _disabled = True
        _stream = None
        return False


def reset() -> None:
    """Forget the stream (tests)."""
    global _stream, _disabled
    if _stream is not None:
        _stream.close()
    _stream, _disabled = None, False
