"""The contract table of the trainer's series (rlhf_api.trainer_metrics) against both of its sides: the
trainer's exporter (rlhf_trainer.metrics) exposes exactly its rows, and the operator's parser
(rlhf_operator.scrape) knows exactly them and reads each row that names a field into that field."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import rlhf_trainer.metrics as trainer_metrics_module
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from rlhf_api import trainer_metrics
from rlhf_api.trainer_metrics import JOB_LABEL, SERIES, Series, sample_names, series_of
from rlhf_operator import scrape
from rlhf_operator.scrape import ScrapedMetrics, parse_metrics
from rlhf_trainer.metrics import TrainerExporter

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def _exposed(m: TrainerExporter) -> dict[str, set[str]]:
    """Series name on /metrics -> the label names its samples carry (a counter's name with `_total`)."""
    out: dict[str, set[str]] = {}
    for fam in text_string_to_metric_families(generate_latest(m.registry).decode()):
        for s in fam.samples:
            row = series_of(s.name)
            assert row is not None, f"{s.name} is exported but has no row in the contract table"
            out.setdefault(row.name, set()).update(k for k in s.labels if k not in ("le",))
    return out


def _set_lazy(m: TrainerExporter) -> None:
    """Give each series that appears only once set (eager=False) one child, with a value per label."""
    for s in SERIES:
        if not s.eager:
            m.series[s.name].labels(m.job, *(f"x{i}" for i, _ in enumerate(s.labels)))


def test_the_exporter_exposes_exactly_the_table_with_its_labels() -> None:
    m = TrainerExporter("job-a")
    _set_lazy(m)
    exposed = _exposed(m)
    assert set(exposed) == {s.name for s in SERIES}
    for s in SERIES:
        assert exposed[s.name] == {JOB_LABEL, *s.labels}, s.name
        assert "job" not in s.labels  # Prometheus owns `job`


def test_eager_series_exist_from_the_start_and_lazy_ones_do_not() -> None:
    exposed = _exposed(TrainerExporter("job-a"))
    assert set(exposed) == {s.name for s in SERIES if s.eager}


def test_the_parser_knows_every_series_of_the_table_and_only_those() -> None:
    m = TrainerExporter("job-a")
    _set_lazy(m)
    text = generate_latest(m.registry).decode()
    assert parse_metrics(text, "job-a").unknown_series == set()
    newer = text + '# TYPE rlhf_from_a_newer_trainer gauge\nrlhf_from_a_newer_trainer{rlhfjob="job-a"} 1\n'
    assert parse_metrics(newer, "job-a").unknown_series == {"rlhf_from_a_newer_trainer"}


def test_every_series_the_parser_names_is_in_the_table() -> None:
    source = Path(scrape.__file__).read_text()
    named = set(re.findall(r'"(rlhf_\w+)"', source))
    assert named, "the parser names the series it reads by label"
    assert {n for n in named if series_of(n) is None} == set()


@pytest.mark.parametrize("row", [s for s in SERIES if s.field is not None], ids=lambda s: s.name)
def test_a_row_with_a_field_is_read_into_that_field(row: Series) -> None:
    m = TrainerExporter("job-a")
    child = m.series[row.name].labels("job-a")
    if row.kind == "counter":
        child.inc(7)
    else:
        child.set(7)
    got = parse_metrics(generate_latest(m.registry).decode(), "job-a")
    assert getattr(got, str(row.field)) == 7
    assert str(row.field) in ScrapedMetrics.__dataclass_fields__


def test_a_new_row_is_exported_and_known_with_no_other_change(monkeypatch: pytest.MonkeyPatch) -> None:
    """Adding a reported series is one row: the exporter and the parser pick it up from the table."""
    row = Series("rlhf_tool_calls_total", "counter", ("tool",), "Tool calls", values=(("search",),))
    table = (*SERIES, row)
    monkeypatch.setattr(trainer_metrics, "SERIES", table)
    monkeypatch.setattr(trainer_metrics, "BY_NAME", {s.name: s for s in table})
    monkeypatch.setattr(trainer_metrics_module, "SERIES", table)
    m = TrainerExporter("job-a")
    assert _exposed(m)["rlhf_tool_calls_total"] == {JOB_LABEL, "tool"}
    m.counter("rlhf_tool_calls_total").labels("job-a", "search").inc()
    assert parse_metrics(generate_latest(m.registry).decode(), "job-a").unknown_series == set()


def test_sample_names_of_a_histogram_are_its_parts() -> None:
    staleness = trainer_metrics.BY_NAME["rlhf_sample_staleness"]
    assert sample_names(staleness) == (
        "rlhf_sample_staleness_bucket",
        "rlhf_sample_staleness_sum",
        "rlhf_sample_staleness_count",
    )
    assert series_of("rlhf_sample_staleness_sum") is staleness
    assert series_of("rlhf_kl_sum") is None  # a gauge has no parts
