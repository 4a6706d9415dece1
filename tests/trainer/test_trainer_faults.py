"""Fault-injection switch of the trainer (rlhf_trainer.faults) and the phase-start hook it rides on."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from rlhf_trainer.faults import FaultInjector, InjectedFault, armed
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


def _no_victim(phase: str) -> tuple[str, int]:
    raise AssertionError(f"the hold killed someone (phase {phase})")


def test_the_checkpoint_hold_waits_for_its_release_before_the_commit_and_fires_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`checkpoint_hold@3` holds step 3's save between the shards and the commit, where `checkpoint@3`
    kills, until the test releases it: the preemption test sends its second SIGTERM in that window."""
    marks, root = tmp_path / "faults", tmp_path / "ckpt"
    (root / ".tmp-step-00000003-abcd1234").mkdir(parents=True)
    monkeypatch.setenv("RLHF_TRAINER_FAULTS", "checkpoint_hold@3")
    monkeypatch.setenv("RLHF_TRAINER_FAULTS_DIR", str(marks))
    faults = FaultInjector.from_env(_no_victim, root)
    assert faults is not None
    faults.checkpoint_written(2)  # another step's save: not held
    faults.phase_started(3, "checkpoint")  # only the written-shards hook holds
    assert not marks.exists()

    errors: list[BaseException] = []

    def save() -> None:
        try:
            faults.checkpoint_written(3)
        except BaseException as e:  # reported by the test's thread
            errors.append(e)

    saver = threading.Thread(target=save, daemon=True)
    saver.start()
    marker = marks / "checkpoint_hold@3"
    deadline = time.monotonic() + 10
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert json.loads(marker.read_text())["partial_checkpoints"] == [".tmp-step-00000003-abcd1234"]
    saver.join(0.5)
    assert saver.is_alive(), "the save went on to its commit without being released"
    (marks / "checkpoint_hold@3.release").touch()
    saver.join(5)
    assert not saver.is_alive() and not errors, errors
    # Fired once: the resumed attempt's save of step 3 is not held again (its marker exists).
    (marks / "checkpoint_hold@3.release").unlink()
    t0 = time.monotonic()
    faults.checkpoint_written(3)
    assert time.monotonic() - t0 < 0.5


def test_an_unreleased_checkpoint_hold_fails_the_save_naming_the_file_it_waited_for(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("RLHF_TRAINER_FAULTS", "checkpoint_hold@3")
    monkeypatch.setenv("RLHF_TRAINER_FAULTS_DIR", str(tmp_path))
    monkeypatch.setenv("RLHF_TRAINER_FAULTS_HOLD_SECONDS", "0.2")
    faults = FaultInjector.from_env(_no_victim, None)
    assert faults is not None
    with pytest.raises(InjectedFault, match=r"checkpoint_hold@3\.release did not appear within 0\.2 s"):
        faults.checkpoint_written(3)


def test_unset_no_fault_layer_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RLHF_TRAINER_FAULTS", raising=False)
    assert FaultInjector.from_env(_no_victim, None) is None


def test_the_mid_sync_engine_kill_fires_once_in_its_steps_sync_on_engine_0(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`engine_weight_sync@N` kills engine 0 (the generation victim) from the manager's while_sending hook
    of step N's sync only, once per marker; a real SIGKILL of a real child process."""
    import subprocess
    import sys

    monkeypatch.setenv("RLHF_TRAINER_FAULTS", "engine_weight_sync@3")
    monkeypatch.setenv("RLHF_TRAINER_FAULTS_DIR", str(tmp_path))
    engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    asked: list[str] = []

    def victim(phase: str) -> tuple[str, int]:
        asked.append(phase)
        return "rollout engine 0", engine.pid

    faults = FaultInjector(victim, None)
    try:
        faults.phase_started(2, "weight_sync")
        faults.weights_sending()  # step 2: not armed
        assert engine.poll() is None and not asked
        faults.phase_started(3, "weight_sync")
        faults.weights_sending()
        assert engine.wait(10) == -9 and asked == ["generation"]
        assert json.loads((tmp_path / "engine_weight_sync@3").read_text())["pid"] == engine.pid
        faults.weights_sending()  # the resumed attempt passes its marker
        assert asked == ["generation"]
    finally:
        engine.kill()


def test_a_marker_appears_whole_never_half_written(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A test polls for a fault's marker and reads it the moment it exists: the marker is written aside and
    renamed into place, so it never exists empty or cut short (the unit stage once read an empty one)."""
    from rlhf_trainer import fault_env

    written: list[Path] = []
    real = Path.write_text

    def spy(self: Path, data: str, *args: Any, **kwargs: Any) -> int:
        written.append(self)
        return real(self, data, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", spy)
    marker = tmp_path / "faults" / "checkpoint_hold@3"
    fault_env.write_marker(marker, {"who": "actor rank 0", "pid": 1})
    assert written and marker not in written  # never written where the test looks
    assert json.loads(marker.read_text()) == {"who": "actor rank 0", "pid": 1}
    assert [p.name for p in marker.parent.iterdir()] == [marker.name]  # nothing left aside
