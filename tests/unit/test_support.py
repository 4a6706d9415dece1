"""The tests' reader of the driver's per-step reports, on the log shapes Ray really produces."""

from __future__ import annotations

import pytest
from support import step_reports

pytestmark = pytest.mark.unit


def test_a_report_glued_behind_a_deduplicated_worker_line_is_still_read() -> None:
    # Seen in CI: Ray's "[repeated 4x across cluster]" line had no newline before the driver's report.
    logs = "\n".join(
        [
            '{"step": 30, "engines": [0, 3]}',
            "\x1b[36m(RolloutEngine pid=2692)\x1b[0m INFO reset prefix cache\x1b[32m [repeated 4x across cluster]"
            '\x1b[0m{"step": 31, "engines": [0, 3]}',
            "(ModelRank pid=435) FutureWarning: all_gather_into_tensor is deprecated",
            '{"step": 32, "engines": [0]}',
        ]
    )
    assert [r["step"] for r in step_reports(logs)] == [30, 31, 32]
    assert step_reports("no reports here\n") == []
