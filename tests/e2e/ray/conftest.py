"""Fixtures of the trainer tests: one offline tiny model for the session, a private Ray temp dir, and
cleanup of processes a test starts. The helpers that run `rlhf run` live in trainer_runs.py.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rlhf_trainer.tiny_model import make_tiny_model

    out = tmp_path_factory.mktemp("tiny")
    make_tiny_model(out)
    return out


@pytest.fixture(scope="session")
def ray_tmp() -> Iterator[Path]:
    """Ray's temp dir for every run of the session: short (Ray's unix sockets live under it) and private."""
    path = Path(tempfile.mkdtemp(prefix="rlhf-ray-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


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
