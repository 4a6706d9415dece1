"""docs/monitoring.md's list of the trainer's series is the contract table (rlhf_api.trainer_metrics):
the same series, each with the table's type and labels, in the table's order. The meaning column is the
docs' own (longer than a series' HELP)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from rlhf_api.trainer_metrics import JOB_LABEL, PHASES, SERIES

pytestmark = pytest.mark.unit

DOC = Path(__file__).resolve().parents[2] / "docs" / "monitoring.md"


def trainer_rows(text: str) -> list[tuple[str, str, tuple[str, ...]]]:
    """(name, type, labels) of each row of the table under '### Trainer' (the type's first word)."""
    section = text.split("### Trainer", 1)[1].split("\n### ", 1)[0]
    rows = []
    for line in section.splitlines():
        m = re.match(r"\| `(rlhf_\w+)` \| (\w+)[^|]* \| ([^|]*) \|", line)
        if m:
            labels = tuple(re.findall(r"`(\w+)`", m.group(3)))
            rows.append((m.group(1), m.group(2), labels))
    return rows


def test_the_docs_list_the_tables_series_with_their_types_and_labels() -> None:
    documented = trainer_rows(DOC.read_text())
    assert documented, f"no trainer metric table under '### Trainer' in {DOC}"
    table = [(s.name, s.kind, (JOB_LABEL, *s.labels)) for s in SERIES]
    assert documented == table


def test_a_row_that_disagrees_is_found() -> None:
    text = DOC.read_text().replace("| `rlhf_kl` | gauge |", "| `rlhf_kl` | counter |")
    assert ("rlhf_kl", "counter", (JOB_LABEL,)) in trainer_rows(text)


def test_the_docs_name_the_phases_of_the_table_in_step_order() -> None:
    sentence = DOC.read_text().split("Phase names, in step order:", 1)[1].split("(", 1)[0]
    assert tuple(re.findall(r"`(\w+)`", sentence)) == PHASES
