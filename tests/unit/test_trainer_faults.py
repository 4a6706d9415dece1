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


def test_the_start_fault_exits_like_a_crash_every_attempt_and_bad_input_exits_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The operator restarts exit 1 and fails exit 2 at once (INPUT_ERROR_EXIT_CODE): the lifecycle
    tests' restartable failure must be the first, and a bad spec the second."""
    from rlhf_api.constants import INPUT_ERROR_EXIT_CODE
    from rlhf_trainer import driver

    bad_spec = ["--spec-json", '{"model": {}}']
    monkeypatch.setenv("RLHF_TRAINER_FAULTS", "start@0")
    assert [driver.main(bad_spec) for _ in range(2)] == [1, 1]  # no marker: it fires in every attempt
    assert "the driver fails at start-up" in capsys.readouterr().err
    monkeypatch.delenv("RLHF_TRAINER_FAULTS")
    assert driver.main(bad_spec) == INPUT_ERROR_EXIT_CODE == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("error: ") and "spec" in err[0], err
