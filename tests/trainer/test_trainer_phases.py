"""Phase timer and the trainer's metric names (rlhf_trainer.metrics): the docs/monitoring.md contract."""

from __future__ import annotations

import time

import pytest
from prometheus_client import generate_latest
from rlhf_trainer.metrics import PHASES, PhaseTimer, TrainerExporter
from testkit.support import METRICS_CONTRACT as CONTRACT

pytestmark = pytest.mark.unit


def test_timer_marks_in_progress_and_records() -> None:
    m = TrainerExporter("demo")
    t = PhaseTimer(m)
    with t.phase("generation"):
        assert m.phase_in_progress.labels("demo", "generation")._value.get() == 1
        time.sleep(0.01)
    assert m.phase_in_progress.labels("demo", "generation")._value.get() == 0
    assert t.seconds["generation"] >= 0.01
    assert m.phase_started.labels("demo", "generation")._value.get() > 0
    with pytest.raises(ValueError):
        t.start("not_a_phase")


def test_two_phases_run_at_once_each_in_progress_and_timed_on_its_own() -> None:
    """overlap.run_phases starts the experience forwards together and stops each when its own refs are
    done: both are in progress at once, each gets its own seconds, and both gauges return to 0."""
    m = TrainerExporter("demo")
    t = PhaseTimer(m)

    def shown() -> dict[str, float]:
        return {p: m.phase_in_progress.labels("demo", p)._value.get() for p in ("reference", "critic_values")}

    ref0 = t.start("reference")
    critic0 = t.start("critic_values")
    assert shown() == {"reference": 1.0, "critic_values": 1.0}
    assert set(t.running) == {"reference", "critic_values"}
    time.sleep(0.02)
    t.stop("critic_values", critic0)
    assert shown() == {"reference": 1.0, "critic_values": 0.0}  # the other is still running
    time.sleep(0.03)
    t.stop("reference", ref0)
    assert shown() == {"reference": 0.0, "critic_values": 0.0} and not t.running
    assert 0.02 <= t.seconds["critic_values"] < t.seconds["reference"]
    assert t.seconds["reference"] >= 0.05  # its own wall time, not what was left after the other ended


def test_exposition_has_every_contract_series_with_rlhfjob_label() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    m = TrainerExporter("demo")
    m.step_done({"generation": 1.5, "weight_sync": 0.1}, 1.6)
    text = generate_latest(m.registry).decode()
    samples = [s for fam in text_string_to_metric_families(text) for s in fam.samples]
    names = {s.name for s in samples}
    for name in CONTRACT:
        assert name in names, name
    for s in samples:
        if s.name.startswith("rlhf_") and not s.name.endswith("_created"):
            assert s.labels.get("rlhfjob") == "demo", s
            assert "job" not in s.labels
    phases = {s.labels["phase"] for s in samples if s.name == "rlhf_step_phase_seconds"}
    assert phases == set(PHASES)
    gen = [
        s.value for s in samples if s.name == "rlhf_step_phase_seconds" and s.labels["phase"] == "generation"
    ]
    assert gen == [1.5]
    states = {s.labels["state"] for s in samples if s.name == "rlhf_rollout_engines"}
    assert {"ready", "starting", "failed"} <= states


class _Stop(Exception):
    pass


def _tiny_spec() -> object:
    from pathlib import Path

    import yaml
    from rlhf_trainer.config import parse_spec

    example = Path(__file__).resolve().parents[2] / "examples" / "rlhfjob-tiny.yaml"
    return parse_spec(yaml.safe_load(example.read_text()))


def _fake_run(monkeypatch: pytest.MonkeyPatch, seen: dict[str, object], resume_at: int | None) -> None:
    """Stands in for Ray, placement and the checkpointer in driver.run: records what /metrics shows when
    placement starts, then stops the run there (resume_at None) or resumes at that step and runs no step."""
    from types import SimpleNamespace

    from rlhf_trainer import driver

    class Exporter(TrainerExporter):
        def __init__(self, job: str) -> None:
            super().__init__(job)
            seen["metrics"] = self

    def place(spec: object, info: object, log: object) -> object:
        m = seen["metrics"]
        assert isinstance(m, TrainerExporter)
        seen["ts_at_place"] = m.last_step_ts.labels(m.job)._value.get()
        seen["steps_at_place"] = m.steps_completed.labels(m.job)._value.get()
        seen["checkpoint_at_place"] = m.last_checkpoint_step.labels(m.job)._value.get()
        if resume_at is None:
            raise _Stop
        pool = SimpleNamespace(ready=lambda: [], shutdown=lambda: None, options={})
        return SimpleNamespace(actor=None, pool=pool, groups=(), victim=None, shutdown=lambda: None)

    class Checkpointer:
        def __init__(self, *args: object) -> None:
            self.written: list[str] = []
            self.resume_info: dict[str, object] = {}
            self.trained_position: dict[str, object] | None = None
            self.algorithm_state: dict[str, object] = {}

        def resume(self) -> int:
            assert resume_at is not None
            return resume_at

    monkeypatch.setattr(driver, "TrainerExporter", Exporter)
    monkeypatch.setattr(driver, "connect_ray", lambda processes, standin_gpus=0: False)
    monkeypatch.setattr(driver, "place", place)
    monkeypatch.setattr(driver, "start", lambda placed, spec, metrics, log: None)
    monkeypatch.setattr(driver, "resume_point", lambda spec, job: 0 if resume_at is None else resume_at - 1)
    monkeypatch.setattr(driver, "Checkpointer", Checkpointer)


class _Data:
    class position:  # mimics PromptDataset.position
        @staticmethod
        def to_dict() -> dict[str, int]:
            return {"epoch": 0, "offset": 0}


def test_driver_sets_last_step_time_to_its_start_before_the_first_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """docs/monitoring.md: before the first step rlhf_last_step_completed_timestamp_seconds holds the
    driver's start time (not 0), so RLHFJobStepStalled also catches a run stuck in its first step."""
    from rlhf_trainer import driver

    seen: dict[str, object] = {}
    _fake_run(monkeypatch, seen, None)
    t0 = time.time()
    with pytest.raises(_Stop):
        driver.run(_tiny_spec(), "demo", metrics_port=0, data=_Data(), log=lambda m: None)  # type: ignore[arg-type]
    assert t0 <= float(seen["ts_at_place"]) <= time.time()  # type: ignore[arg-type]
    m = seen["metrics"]
    assert isinstance(m, TrainerExporter)
    assert m.steps_completed.labels("demo")._value.get() == 0
    assert seen["checkpoint_at_place"] == 0  # a fresh start: no checkpoint yet


def test_a_resumed_driver_counts_steps_from_the_checkpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/monitoring.md: after a restart from a checkpoint rlhf_steps_completed_total resumes from the
    checkpoint's step (the operator's status.step follows it)."""
    from rlhf_trainer import driver

    seen: dict[str, object] = {}
    _fake_run(monkeypatch, seen, 9)  # resumed from step 8's checkpoint
    summary = driver.run(_tiny_spec(), "demo", steps=0, metrics_port=0, data=_Data(), log=lambda m: None)  # type: ignore[arg-type]
    assert summary["steps"] == []
    m = seen["metrics"]
    assert isinstance(m, TrainerExporter)
    assert m.steps_completed.labels("demo")._value.get() == 8
    # Announced before the minute of start-up (placement), so `kubectl get rlhf` never shows 0/N mid-run.
    assert seen["steps_at_place"] == 8
    assert seen["checkpoint_at_place"] == 8  # rlhf_last_checkpoint_step: the checkpoint resumed from
    m.step_done({"generation": 1.0}, 1.0)
    assert m.steps_completed.labels("demo")._value.get() == 9
    assert m.last_step_ts.labels("demo")._value.get() >= float(seen["ts_at_place"])  # type: ignore[arg-type]


def test_a_phase_that_did_not_run_in_the_last_step_reports_zero() -> None:
    """docs/monitoring.md: rlhf_step_phase_seconds is the last completed step; `checkpoint` (not due every
    step) must not keep an older step's duration, or the step time and generation share drift."""
    m = TrainerExporter("demo")
    m.step_done({"generation": 2.0, "weight_sync": 0.5, "checkpoint": 3.0}, 5.5)
    m.step_done({"generation": 1.0, "weight_sync": 0.25}, 1.25)
    got = {p: m.step_phase_seconds.labels("demo", p)._value.get() for p in PHASES}
    assert got == {**dict.fromkeys(PHASES, 0.0), "generation": 1.0, "weight_sync": 0.25}
