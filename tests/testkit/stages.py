"""The stages of `make test` and which of them select a test: no test may fall outside every stage.

Owns reading the stage table from scripts/test.sh (its `pytest_stage NAME PATH... -m "EXPR"` lines are
the one source of truth) and the collection checks conftest.py runs. Must not choose stages itself: a
test belongs to a stage only through its markers, as `pytest -m` decides; a stage's paths only say where
it collects (collecting the whole tree costs each stage about 12 s of imports), so a test its expression
selects outside them fails collection instead of silently running in no stage.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest
from _pytest.mark.expression import Expression

TEST_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "test.sh"
_STAGE_LINE = re.compile(r"^\s*pytest_stage\s+(.*?)\s*(?:\|\||$)")


@dataclass(frozen=True)
class Stage:
    """One `pytest_stage` line: where it collects (paths relative to the repository) and what it selects."""

    paths: tuple[str, ...]
    expr: str

    def collects(self, nodeid_path: str) -> bool:
        """Whether a test file (its path relative to the repository, as in a node id) is under a path."""
        return any(nodeid_path == p or nodeid_path.startswith(p.rstrip("/") + "/") for p in self.paths)


def stage_table(script: Path = TEST_SCRIPT) -> dict[str, Stage]:
    """{stage name: its paths and `-m` expression}, in the order scripts/test.sh runs them."""
    stages: dict[str, Stage] = {}
    for line in script.read_text().splitlines():
        match = _STAGE_LINE.match(line.split("#", 1)[0])
        if not match:
            continue
        words = shlex.split(match.group(1))
        paths = tuple(words[1 : words.index("-m")]) if "-m" in words else ()
        if not paths or not all(p == "tests" or p.startswith("tests/") for p in paths):
            raise ValueError(
                f"{script}: a stage must run `PATH... -m EXPR`, paths under tests/: {line.strip()!r}"
            )
        stages[words[0]] = Stage(paths, words[words.index("-m") + 1])
    if not stages:
        raise ValueError(f"{script}: no `pytest_stage NAME PATH... -m EXPR` line found")
    return stages


def stages_of(markers: Iterable[str], table: Mapping[str, Stage]) -> list[str]:
    """The stages whose expression selects a test carrying `markers` (pytest's own -m evaluation)."""
    names = set(markers)
    return [name for name, st in table.items() if Expression.compile(st.expr).evaluate(names.__contains__)]


def _markers(item: pytest.Item) -> list[str]:
    return [m.name for m in item.iter_markers()]


def unstaged(items: Iterable[pytest.Item], table: Mapping[str, Stage]) -> list[str]:
    """Node ids of the collected tests that no stage's expression selects."""
    return [item.nodeid for item in items if not stages_of(_markers(item), table)]


def outside_paths(items: Iterable[pytest.Item], table: Mapping[str, Stage], root: Path) -> list[str]:
    """'node id (stage S collects only P)' for each test a stage selects by marker but does not collect."""
    found = []
    for item in items:
        file = Path(str(item.path)).resolve()
        if not file.is_relative_to(root):
            continue  # not a file of this tree (a pytester probe): no stage of test.sh could collect it
        rel = file.relative_to(root).as_posix()
        for name in stages_of(_markers(item), table):
            if not table[name].collects(rel):
                found.append(f"{item.nodeid} (stage {name} collects only {' '.join(table[name].paths)})")
    return found


def check_collection(items: list[pytest.Item], script: Path = TEST_SCRIPT) -> None:
    """Fail collection, naming the tests, when a collected test runs in no stage of `make test`: no stage
    selects it, or one that selects it does not collect its file."""
    table = stage_table(script)
    problems = [
        (unstaged(items, table), "run in no stage of `make test` ({name} selects by marker): give each a "
         "stage marker (pytestmark = pytest.mark.<stage>)"),
        (outside_paths(items, table, script.resolve().parents[1]), "lie outside the paths of a stage that "
         "selects them ({name}'s `pytest_stage NAME PATH... -m EXPR` lines): move the test or add its path"),
    ]  # fmt: skip
    for missing, why in problems:
        if missing:
            shown = "\n  ".join(missing[:20]) + (
                f"\n  ... and {len(missing) - 20} more" if len(missing) > 20 else ""
            )
            raise pytest.UsageError(f"{len(missing)} test(s) {why.format(name=script.name)}:\n  {shown}")
