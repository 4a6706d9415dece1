"""The test tree's layout (docs/development.md, "Where a new test goes"): fast tests mirror the packages,
end-to-end groups live under tests/e2e/, shared helpers in the `testkit` package, no test module imports
another, nothing edits `sys.path`, and each fixture and helper is defined once."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
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


# Public testkit names that several testkit modules define, each for a contract with something outside the
# module that calls it by that name. `main`: the entry point of a module run as a script (exempt only where the
# module has an `if __name__ == "__main__":`). `reward`: the reward function the trainer loads from a file as
# `path/to/<module>.py:reward` (control_reward.py, agent_task.py); the e2e jobs' specs name it so, and the stall
# diagnosis they assert on quotes it.
ENTRY_POINTS = {"main", "reward"}


def _functions(tree: ast.Module) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [n for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]


def _is_fixture(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """Decorated by a `fixture` (pytest's, pytest_asyncio's, called or not; not `mark.usefixtures`)."""
    return any(
        ast.unparse(d.func if isinstance(d, ast.Call) else d).rsplit(".", 1)[-1] == "fixture"
        for d in fn.decorator_list
    )


def _runs_as_script(tree: ast.Module) -> bool:
    return any(isinstance(n, ast.If) and ast.unparse(n.test) == "__name__ == '__main__'" for n in tree.body)


def _body(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    """The function's body, its docstring left out, as ast.dump gives it (no line numbers): equal for a copy."""
    body = fn.body
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0].value, "value", None), str):
        body = body[1:]
    return "\n".join(ast.dump(stmt) for stmt in body)


def test_each_fixture_and_helper_is_defined_once() -> None:
    """Module-level functions across tests/: (a) a fixture name is defined once (a second definition would
    shadow the first for some tests only); (b) a name means one thing: no function of a test module or a
    conftest is named (leading underscores aside) as a public function of testkit, and no two testkit
    modules define the same public name (save ENTRY_POINTS); (c) no function body is in two modules: a
    helper that two modules need is defined in testkit, once, and imported."""
    fixtures: defaultdict[str, list[str]] = defaultdict(list)
    kit: defaultdict[str, list[str]] = defaultdict(list)
    kit_entry_points: set[str] = set()
    local: list[tuple[str, str]] = []  # (where, its name without leading underscores)
    bodies: defaultdict[str, list[tuple[Path, str]]] = defaultdict(list)
    for path in _modules():
        rel = path.relative_to(TESTS)
        tree = ast.parse(path.read_text(), str(path))
        for fn in _functions(tree):
            where = f"{rel}: {fn.name}"
            if _is_fixture(fn):
                fixtures[fn.name].append(where)
            if rel.parts[0] != "testkit":
                local.append((where, fn.name.lstrip("_")))
            elif not fn.name.startswith("_"):
                kit[fn.name].append(where)
                if fn.name in ENTRY_POINTS and (fn.name != "main" or _runs_as_script(tree)):
                    kit_entry_points.add(where)
            if body := _body(fn):
                bodies[body].append((rel, where))
    offences = [
        f"{w} (a fixture defined {len(ws)} times)" for ws in fixtures.values() if len(ws) > 1 for w in ws
    ]
    offences += [
        f"{where} (testkit defines {name}: {', '.join(kit[name])})" for where, name in local if name in kit
    ]
    offences += [
        f"{w} (a public testkit name {len(ws)} testkit modules define)"
        for ws in kit.values()
        if len(ws) > 1 and not set(ws) <= kit_entry_points
        for w in ws
    ]
    offences += [
        f"{where} (the same body as {', '.join(w for m, w in defs if m != rel)})"
        for defs in bodies.values()
        if len({m for m, _ in defs}) > 1
        for rel, where in defs
    ]
    assert not offences, "defined more than once:\n" + "\n".join(offences)


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
