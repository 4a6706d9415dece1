"""A rules linter written by others over the chart's rules as rendered: `promtool check rules --lint=all
--lint-fatal` (the Prometheus project's own checker: syntax, types, template expansion of every
annotation, and its lint, duplicate rules). cloudflare's pint, the richer linter the issue names,
cannot be fetched here (the Go module proxy answers 403 for every version): docs/monitoring.md.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
from testkit.chart_tools import dump_yaml, prometheus_rules, run, tool

pytestmark = pytest.mark.alerting


def lint(path: Path) -> tuple[int, str]:
    proc = run([tool("promtool"), "check", "rules", "--lint=all", "--lint-fatal", path])
    return proc.returncode, f"{proc.stdout}\n{proc.stderr}"


def test_the_charts_rules_pass_promtools_lint_and_the_lint_catches_a_duplicate(tmp_path: Path) -> None:
    rules = prometheus_rules()
    clean = tmp_path / "rules.yaml"
    clean.write_text(dump_yaml(rules))
    rc, out = lint(clean)
    assert rc == 0 and "SUCCESS" in out, out
    # The same linter on a copy with one rule twice: it reports it and fails (so a finding would fail
    # this test rather than pass unseen).
    doubled = copy.deepcopy(rules)
    doubled["groups"][0]["rules"].append(copy.deepcopy(doubled["groups"][0]["rules"][0]))
    bad = tmp_path / "doubled.yaml"
    bad.write_text(dump_yaml(doubled))
    rc, out = lint(bad)
    assert rc != 0 and "duplicate" in out.lower(), out
