"""Phase timer and the trainer's metric names (rlhf_trainer.phases): the DESIGN §4 contract."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("prometheus_client")

from prometheus_client import generate_latest
from rlhf_trainer.phases import PHASES, PhaseTimer, TrainerMetrics

pytestmark = pytest.mark.unit

CONTRACT = [
    "rlhf_step_phase_seconds",
    "rlhf_phase_duration_seconds_bucket",
    "rlhf_phase_in_progress",
    "rlhf_phase_started_timestamp_seconds",
    "rlhf_steps_completed_total",
    "rlhf_last_step_completed_timestamp_seconds",
    "rlhf_total_steps",
    "rlhf_stall_timeout_seconds",
    "rlhf_generated_tokens_total",
    "rlhf_trained_tokens_total",
    "rlhf_reward_mean",
    "rlhf_kl",
    "rlhf_reward_errors_total",
    "rlhf_weight_sync_bytes_total",
    "rlhf_rollout_engines",
]


def test_timer_marks_in_progress_and_records() -> None:
    m = TrainerMetrics("demo")
    t = PhaseTimer(m)
    with t.phase("generation"):
        assert m.phase_in_progress.labels("demo", "generation")._value.get() == 1
        time.sleep(0.01)
    assert m.phase_in_progress.labels("demo", "generation")._value.get() == 0
    assert t.seconds["generation"] >= 0.01
    assert m.phase_started.labels("demo", "generation")._value.get() > 0
    with pytest.raises(ValueError):
        t.start("not_a_phase")


def test_exposition_has_every_contract_series_with_rlhfjob_label() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    m = TrainerMetrics("demo")
    m.step_done({"generation": 1.5, "weight_sync": 0.1})
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
