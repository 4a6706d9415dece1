"""devcluster/ runs before the virtualenv exists (`make setup` builds and starts the control plane with
the system python3): the package and its script import only the standard library, node.py, each other
and images/'s recipes (node.py starts containerd with them; they are standard library only too)."""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest
from testkit import TESTKIT

pytestmark = pytest.mark.unit

DEVCLUSTER = TESTKIT.parents[1] / "devcluster"
OURS = {"node", "devcluster", "__future__", *(p.stem for p in (DEVCLUSTER.parent / "images").glob("*.py"))}


def test_devcluster_imports_only_the_standard_library() -> None:
    offences = []
    for path in sorted(DEVCLUSTER.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and not node.level
                else []
            )
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top not in OURS:
                    offences.append(f"{path.relative_to(DEVCLUSTER)}:{node.lineno}: {name}")
    assert not offences, offences


def test_the_script_runs_without_site_packages() -> None:
    proc = subprocess.run(
        [sys.executable, "-S", "-s", "-E", str(DEVCLUSTER / "devcluster.py"), "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "build|up|down|status" in proc.stdout
