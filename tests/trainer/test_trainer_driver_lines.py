"""The driver's lines reach the Ray job's log whole (driver._say): each with its newline in one write.

Ray prints the workers' log lines into the driver's stdout from a thread of its own. A line written as
`print` writes it (the text, then the newline apart) let one of those land inside a step report: the
alerting test read `{"step": 10, ...}(EngineCore pid=...) INFO ...` as one line, and its JSON failed.
"""

from __future__ import annotations

import io
import json

import pytest
from rlhf_trainer import driver

pytestmark = pytest.mark.unit


class Recording(io.StringIO):
    """A stream that keeps each write call apart."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[str] = []

    def write(self, s: str) -> int:
        self.writes.append(s)
        return super().write(s)


def test_a_line_and_its_newline_are_one_write() -> None:
    out = Recording()
    line = json.dumps({"step": 3, "reward_mean": 0.5})
    driver._say(line, out)
    assert out.writes == [line + "\n"]
