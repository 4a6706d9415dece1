"""The `rlhf` dispatcher (rlhf_cli): every subcommand reaches the package that owns it, `--version`
prints the installed version, and a forwarded command whose package is missing says which extra to
install. Runs the installed console script, as users do."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from rlhf_cli import main as cli

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
RLHF = Path(sys.executable).parent / "rlhf"


def rlhf(*args: str) -> subprocess.CompletedProcess[str]:
    assert RLHF.is_file(), f"the `rlhf` console script is not installed at {RLHF} (pip install -e .)"
    return subprocess.run([str(RLHF), *args], capture_output=True, text=True, timeout=120)


def test_version_is_the_project_version() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    proc = rlhf("--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"rlhf {project['version']}"


def test_help_lists_every_subcommand() -> None:
    proc = rlhf("--help")
    assert proc.returncode == 0, proc.stderr
    for command in ("crd", "validate", "run", "make-tiny-model", "operator"):
        assert f"    {command}" in proc.stdout, command


@pytest.mark.parametrize("command", ["run", "make-tiny-model", "operator"])
def test_forwarded_commands_reach_their_owner(command: str) -> None:
    """`--help` goes to the target's own parser (its prog names the subcommand)."""
    proc = rlhf(command, "--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"usage: rlhf {command}"), proc.stdout[:300]


def test_a_missing_package_names_the_extra(capsys: pytest.CaptureFixture[str]) -> None:
    forwarded = cli.Forwarded("help", "rlhf_no_such_package.cli", "main", "operator")
    assert forwarded("operator", []) == 2
    assert "rlhf operator: cannot import 'rlhf_no_such_package'; install the [operator] extra" in (
        capsys.readouterr().err
    )


def test_the_dispatcher_imports_neither_side_until_chosen() -> None:
    code = (
        "import sys\n"
        "import rlhf_cli.main\n"
        "print(sorted(m for m in ('rlhf_operator', 'rlhf_trainer', 'kopf', 'torch', 'ray') if m in sys.modules))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
