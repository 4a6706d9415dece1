"""The chart's alerts, tested with promtool on the rules exactly as the chart renders them.

Renders the PrometheusRule with helm, extracts its groups into a rule file, checks it with
`promtool check rules`, and runs every tests/chart/alert_rules/*.yaml unit-test file against it. Every alert
must have a test where it fires and one where it stays quiet. Needs helm and promtool (no cluster).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from testkit.chart_tools import ROOT, dump_yaml, prometheus_rules, run, tool

pytestmark = pytest.mark.unit

HERE = Path(__file__).resolve().parent
TEST_FILES = sorted(HERE.glob("*.yaml"))
MONITORING_DOC = ROOT / "docs" / "monitoring.md"
SEVERITIES = {"critical", "warning", "info"}
# Alerts about one RLHFJob carry its identity; RLHFOperatorDown is about the operator itself.
PER_JOB_LABELS = {"namespace", "rlhfjob"}


@pytest.fixture(scope="module")
def rules() -> dict[str, Any]:
    return prometheus_rules()


@pytest.fixture(scope="module")
def rules_file(rules: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("rules") / "rules.yaml"
    path.write_text(dump_yaml(rules))
    return path


def alert_rules(rules: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for g in rules["groups"] for r in g["rules"] if "alert" in r]


def load_tests() -> dict[Path, dict[str, Any]]:
    return {f: yaml.safe_load(f.read_text()) for f in TEST_FILES}


def test_there_are_alert_test_files() -> None:
    assert TEST_FILES, f"no promtool test files in {HERE}"


def test_promtool_check_rules(rules_file: Path) -> None:
    proc = run([tool("promtool"), "check", "rules", rules_file])
    assert proc.returncode == 0, (
        f"promtool check rules failed:\n{proc.stdout}\n{proc.stderr}\n{rules_file.read_text()}"
    )


@pytest.mark.parametrize("test_file", TEST_FILES, ids=lambda p: p.name)
def test_promtool_unit_tests(test_file: Path, rules_file: Path, tmp_path: Path) -> None:
    spec = yaml.safe_load(test_file.read_text())
    # Each file names the placeholder `rules.yaml`; run it against the rendered rules instead.
    assert spec.get("rule_files") == ["rules.yaml"], f"{test_file.name}: rule_files must be [rules.yaml]"
    spec["rule_files"] = [str(rules_file)]
    copy = tmp_path / test_file.name
    copy.write_text(dump_yaml(spec))
    proc = run([tool("promtool"), "test", "rules", copy])
    assert proc.returncode == 0, f"promtool test rules {test_file.name} failed:\n{proc.stdout}\n{proc.stderr}"


def test_every_alert_has_a_firing_and_a_quiet_test(rules: dict[str, Any]) -> None:
    names = {r["alert"] for r in alert_rules(rules)}
    fires: set[str] = set()
    quiet: set[str] = set()
    for spec in load_tests().values():
        for case in spec["tests"]:
            for check in case.get("alert_rule_test", []):
                (fires if check.get("exp_alerts") else quiet).add(check["alertname"])
    assert names, "the rendered PrometheusRule has no alerts"
    assert not (fires | quiet) - names, (
        f"tests for alerts the chart does not define: {sorted((fires | quiet) - names)}"
    )
    assert not names - fires, f"alerts with no test where they fire: {sorted(names - fires)}"
    assert not names - quiet, f"alerts with no test where they stay quiet: {sorted(names - quiet)}"


def test_firing_alerts_name_the_job(rules: dict[str, Any]) -> None:
    """Per-job alerts fire with `namespace` and `rlhfjob` (and never a `job` label of their own)."""
    for path, spec in load_tests().items():
        for case in spec["tests"]:
            for check in case.get("alert_rule_test", []):
                for alert in check.get("exp_alerts") or []:
                    labels = alert["exp_labels"]
                    where = f"{path.name}: {case['name']}: {check['alertname']}"
                    assert labels.get("severity") in SEVERITIES, where
                    if check["alertname"] == "RLHFOperatorDown":
                        assert {"namespace", "job"} <= labels.keys(), where
                    else:
                        assert labels.keys() >= PER_JOB_LABELS, (
                            f"{where}: missing {PER_JOB_LABELS - labels.keys()}"
                        )
                        assert "job" not in labels, where


def github_anchor(heading: str) -> str:
    """The id GitHub gives a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_alerts_have_severity_annotations_and_a_runbook_section(rules: dict[str, Any]) -> None:
    assert MONITORING_DOC.is_file(), f"{MONITORING_DOC} is missing"
    anchors = {
        github_anchor(line.lstrip("#"))
        for line in MONITORING_DOC.read_text().splitlines()
        if line.startswith("#")
    }
    for rule in alert_rules(rules):
        name = rule["alert"]
        assert rule["labels"]["severity"] in SEVERITIES, name
        annotations = rule["annotations"]
        assert {"summary", "description", "runbook_url"} <= annotations.keys(), name
        url = annotations["runbook_url"]
        assert url.split("#")[0].endswith("/monitoring.md"), url
        anchor = url.split("#", 1)[1]
        assert anchor == name.lower(), f"{name}: runbook anchor {anchor!r}"
        assert anchor in anchors, f"{name}: docs/monitoring.md has no section with anchor #{anchor}"
