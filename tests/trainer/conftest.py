"""Fixtures of the trainer's fast tests (tests/trainer)."""

from __future__ import annotations

from typing import Any

import pytest
from testkit.support import tiny_policy


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A tiny causal LM (random weights), one per test module: the packing and log-prob tests run it."""
    return tiny_policy(tmp_path_factory.mktemp("tiny"))
