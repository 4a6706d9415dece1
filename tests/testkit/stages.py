"""The stages of `make test` and which of them select a test: no test may fall outside every stage.

Owns reading the stage table from scripts/test.sh (its `pytest_stage NAME tests -m "EXPR"` lines are the
one source of truth) and the collection check conftest.py runs. Must not choose stages itself: a test
belongs to a stage only through its markers, as `pytest -m` decides.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest
from _pytest.mark.expression import Expression

TEST_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "test.sh"
_STAGE_LINE = re.compile(r"^\s*pytest_stage\s+(.*?)\s*(?:\|\||$)")


def stage_table(script: Path = TEST_SCRIPT) -> dict[str, str]:
    """{stage name: its `-m` expression}, in the order scripts/test.sh runs them."""
    stages: dict[str, str] = {}
    for line in script.read_text().splitlines():
        match = _STAGE_LINE.match(line.split("#", 1)[0])
        if not match:
            continue
        words = shlex.split(match.group(1))
        if "-m" not in words or words[1:2] != ["tests"]:
            raise ValueError(f"{script}: a stage must run `tests -m EXPR`: {line.strip()!r}")
        stages[words[0]] = words[words.index("-m") + 1]
    if not stages:
        raise ValueError(f"{script}: no `pytest_stage NAME tests -m EXPR` line found")
    return stages


def stages_of(markers: Iterable[str], table: Mapping[str, str]) -> list[str]:
    """The stages whose expression selects a test carrying `markers` (pytest's own -m evaluation)."""
    names = set(markers)
    return [name for name, expr in table.items() if Expression.compile(expr).evaluate(names.__contains__)]


def unstaged(items: Iterable[pytest.Item], table: Mapping[str, str]) -> list[str]:
    """Node ids of the collected tests that no stage runs."""
    return [item.nodeid for item in items if not stages_of((m.name for m in item.iter_markers()), table)]


def check_collection(items: list[pytest.Item], script: Path = TEST_SCRIPT) -> None:
    """Fail collection, naming the tests, when a collected test runs in no stage of `make test`."""
    missing = unstaged(items, stage_table(script))
    if missing:
        shown = "\n  ".join(missing[:20]) + (
            f"\n  ... and {len(missing) - 20} more" if len(missing) > 20 else ""
        )
        raise pytest.UsageError(
            f"{len(missing)} test(s) run in no stage of `make test` ({script.name} selects by marker): "
            f"give each a stage marker (pytestmark = pytest.mark.<stage>):\n  {shown}"
        )
