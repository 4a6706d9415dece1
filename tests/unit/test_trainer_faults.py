"""Fault-injection switch of the trainer (rlhf_trainer.faults) and the phase-start hook it rides on."""

from __future__ import annotations

import pytest
from rlhf_trainer.faults import armed
from rlhf_trainer.metrics import PhaseTimer, TrainerExporter

pytestmark = pytest.mark.unit


def test_armed_faults_parse_and_default_to_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RLHF_TRAINER_FAULTS", raising=False)
    assert armed() == []
    assert armed("generation@2, checkpoint@4") == [("generation", 2), ("checkpoint", 4)]


@pytest.mark.parametrize("bad", ["generation", "generation@", "generation@two"])
def test_a_malformed_fault_is_an_error_not_silently_no_fault(bad: str) -> None:
    with pytest.raises(ValueError, match="phase@step"):
        armed(bad)


def test_the_start_hook_runs_once_the_phase_is_visible_as_in_progress() -> None:
    m = TrainerExporter("j")
    seen: list[tuple[str, float]] = []
    timer = PhaseTimer(
        m, on_start=lambda p: seen.append((p, m.phase_in_progress.labels("j", p)._value.get()))
    )
    with timer.phase("weight_sync"):
        pass
    assert seen == [("weight_sync", 1.0)]
