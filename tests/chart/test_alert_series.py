"""The chart's alert rules, their promtool tests and the dashboard name only series that exist: the
trainer's (the contract table, rlhf_api.trainer_metrics) or the operator's own (rlhf_operator.metrics)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import rlhf_operator.metrics as operator_metrics
from prometheus_client.metrics import MetricWrapperBase
from rlhf_api.trainer_metrics import series_of

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
USERS = [
    ROOT / "charts/rlhf-operator/templates/prometheusrule.yaml",
    ROOT / "charts/rlhf-operator/dashboards/rlhf-training.json",
    *sorted((ROOT / "tests/chart/alert_rules").glob("*.yaml")),
]


def operator_series() -> set[str]:
    """The sample names of the operator's own metrics (a counter's with `_total`, a histogram's parts)."""
    names: set[str] = set()
    for metric in vars(operator_metrics).values():
        if isinstance(metric, MetricWrapperBase):
            for family in metric.describe():
                suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
                names.update(family.name + s for s in suffixes.get(family.type, ("",)))
    return names


def unknown_series(text: str, known: set[str]) -> set[str]:
    return {n for n in re.findall(r"\brlhf_\w+", text) if n not in known and series_of(n) is None}


@pytest.mark.parametrize("path", USERS, ids=lambda p: p.name)
def test_every_series_named_exists(path: Path) -> None:
    text = path.read_text()
    assert unknown_series(text, operator_series()) == set()


def test_the_rules_and_the_dashboard_name_series() -> None:
    for path in USERS[:2]:
        assert len(set(re.findall(r"\brlhf_\w+", path.read_text()))) > 3, f"{path} names no series"


def test_a_series_of_neither_side_is_found() -> None:
    assert operator_series() >= {"rlhf_operator_job_phase", "rlhf_operator_restarts_total"}
    assert unknown_series("rate(rlhf_steps_total[5m])", operator_series()) == {"rlhf_steps_total"}
