"""The test tree's layout (docs/development.md, "Where a new test goes"): fast tests mirror the packages,
end-to-end groups live under tests/e2e/, shared helpers in the `testkit` package, no test module imports
another and nothing edits `sys.path`."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from testkit import TESTKIT, collected

pytestmark = pytest.mark.unit

TESTS = TESTKIT.parent
FAST = {"api", "benchmarks", "chart", "cli", "devcluster", "docs", "images", "operator", "suite", "trainer"}
E2E = TESTS / "e2e"


def _modules() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts)


# A collection of the whole tree in a child process, whose conftest keeps its files (testkit.collected).
_MARKERS_OF_FILES = """
import sys, pytest

class Report:
    def pytest_collection_finish(self, session):
        from testkit import collected  # on sys.path once pytest has read its `pythonpath`

        for kind, files in (collected.files(session.config) or {}).items():
            for file in files:
                print("FILE", kind, file)

sys.exit(pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", sys.argv[1]], plugins=[Report()]))
"""


def _collected(config: pytest.Config) -> tuple[set[Path], set[Path]]:
    """The files of the unit tests and of the others over the whole tree: from this session's collection
    when it collected the whole tree (testkit.collected), else from one pytest collection of it."""
    kept = collected.files(config)
    if kept is None:
        out = subprocess.run(
            [sys.executable, "-c", _MARKERS_OF_FILES, str(TESTS)],
            capture_output=True, text=True, cwd=TESTS.parent, timeout=300,
        )  # fmt: skip
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
        kept = {"unit": set(), "slow": set()}
        for line in out.stdout.splitlines():
            if line.startswith("FILE "):
                _, kind, file = line.split(" ", 2)
                kept[kind].add(Path(file))
    assert kept["unit"] and kept["slow"], f"the collection found no unit or no other test: {kept}"
    return kept["unit"], kept["slow"]


def test_fast_tests_live_in_the_package_folders_and_end_to_end_tests_under_e2e(
    request: pytest.FixtureRequest,
) -> None:
    unit, slow = _collected(request.config)
    misplaced_unit = sorted(str(p.relative_to(TESTS)) for p in unit if E2E in p.parents)
    misplaced_slow = sorted(str(p.relative_to(TESTS)) for p in slow if E2E not in p.parents)
    assert not misplaced_unit, f"fast (unit) tests under tests/e2e/: {misplaced_unit}"
    assert not misplaced_slow, f"end-to-end tests outside tests/e2e/: {misplaced_slow}"
    folders = {p.relative_to(TESTS).parts[0] for p in unit}
    assert folders <= FAST, f"fast tests in folders that mirror no package: {sorted(folders - FAST)}"


def test_no_test_module_imports_another_and_helpers_are_in_testkit() -> None:
    """A test module imports packages and `testkit`, never a `test_*` module or a conftest; helper modules
    (anything not a test or a conftest) live in tests/testkit/."""
    offences: list[str] = []
    for path in _modules():
        rel = path.relative_to(TESTS)
        if not (path.name.startswith("test_") or path.name == "conftest.py") and rel.parts[0] != "testkit":
            offences.append(f"{rel}: a helper outside tests/testkit/")
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            for name in names:
                last = name.rsplit(".", 1)[-1]
                if last.startswith("test_") or last == "conftest":
                    offences.append(f"{rel}: imports {name}")
    assert not offences, offences


def test_nothing_edits_sys_path() -> None:
    """pytest's `pythonpath` puts tests/, devcluster/, images/ and benchmarks/ on the path, once."""
    offences = []
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            target = (
                node.func.value
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                else None
            )
            if isinstance(node, (ast.Assign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                target = next((t.value for t in targets if isinstance(t, ast.Subscript)), None)
            if (
                isinstance(target, ast.Attribute)
                and target.attr == "path"
                and isinstance(target.value, ast.Name)
                and target.value.id == "sys"
            ):
                offences.append(f"{path.relative_to(TESTS)}:{node.lineno}")
    assert not offences, f"sys.path edited at {offences}"
