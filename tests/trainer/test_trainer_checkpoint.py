"""Atomic checkpoints, rotation and resume selection (rlhf_trainer.checkpoint)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from rlhf_api.spec import RLHFJobSpec
from rlhf_trainer.checkpoint import STATE_FILE, CheckpointStore, resume_point, training_identity
from rlhf_trainer.cli import apply_overrides
from rlhf_trainer.config import InputError, parse_spec

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]


def _write(store: CheckpointStore, step: int) -> Path:
    tmp = store.begin(step)
    (tmp / "actor").mkdir()
    (tmp / "actor" / "shard.bin").write_bytes(b"x" * 10)
    return store.commit(tmp, step, {"data": {"epoch": 0, "offset": step * 4}})


def test_commit_is_a_rename_of_a_complete_dir(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    final = _write(store, 3)
    assert final.name == "step-00000003"
    assert json.loads((final / STATE_FILE).read_text())["complete"] is True
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    step, path, state = store.latest()  # type: ignore[misc]
    assert (step, path, state["data"]["offset"]) == (3, final, 12)


def test_crash_mid_write_is_never_resumed(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    _write(store, 2)
    tmp = store.begin(4)  # a crash here: shards written, state never committed
    (tmp / "actor").mkdir()
    (tmp_path / "step-00000005").mkdir()  # a step dir without state (e.g. copied by hand, half done)
    assert store.latest()[0] == 2  # type: ignore[index]
    removed = store.remove_partial()
    assert {p.name for p in removed} == {tmp.name, "step-00000005"}
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000002"]


def test_rotation_keeps_last_n(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    for s in (1, 2, 3, 4):
        _write(store, s)
    store.rotate(keep_last=2)
    assert [s for s, _ in store.complete()] == [3, 4]


def test_abort_removes_temp(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    tmp = store.begin(1)
    store.abort(tmp)
    assert list(tmp_path.iterdir()) == []
    assert store.latest() is None


# ---- whose checkpoint it is: the job and its training-relevant spec ---------------------------------
def _spec(tmp_path: Path, **sets: str) -> RLHFJobSpec:
    doc = yaml.safe_load((ROOT / "examples" / "rlhfjob-tiny.yaml").read_text())
    doc["spec"]["checkpoint"]["path"] = str(tmp_path / "ckpt")
    return parse_spec(apply_overrides(doc, [f"{k}={v}" for k, v in sets.items()]))


def _saved_by(spec: RLHFJobSpec, job: str, step: int) -> Path:
    assert spec.checkpoint.path
    store = CheckpointStore(spec.checkpoint.path)
    tmp = store.begin(step)
    return store.commit(tmp, step, {"data": {}, "job": job, "identity": training_identity(spec)})


def test_the_same_job_and_spec_resume_and_more_total_steps_is_still_a_resume(tmp_path: Path) -> None:
    _saved_by(_spec(tmp_path), "tiny", 20)
    assert resume_point(_spec(tmp_path), "tiny") == 20
    assert resume_point(_spec(tmp_path, **{"algorithm.totalSteps": "40"}), "tiny") == 20
    assert resume_point(_spec(tmp_path, **{"checkpoint.resume": "never"}), "tiny") == 0


def test_another_runs_checkpoint_is_refused_naming_both_sides_and_the_ways_out(tmp_path: Path) -> None:
    _saved_by(_spec(tmp_path), "tiny", 20)
    other = _spec(tmp_path, **{"model.reward.function": "my_rewards:score"})
    with pytest.raises(InputError) as e:
        resume_point(other, "tiny")
    msg = str(e.value)
    assert "step-00000020" in msg and str(tmp_path / "ckpt") in msg
    assert (
        'model.reward.function: "rlhf_trainer.tasks.tiny:reward"' in msg
        and '(this run: "my_rewards:score")' in msg
    )
    assert "another checkpoint.path" in msg and "--resume never" in msg and "--resume force" in msg
    with pytest.raises(InputError, match=r"job 'tiny' \(this run: 'other'\)"):
        resume_point(_spec(tmp_path), "other")
    assert resume_point(_spec(tmp_path, **{"checkpoint.resume": "force"}), "other") == 20


def test_a_checkpoint_from_before_identities_is_resumed(tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    assert spec.checkpoint.path
    store = CheckpointStore(spec.checkpoint.path)
    store.commit(store.begin(5), 5, {"data": {}, "job": "tiny"})
    assert resume_point(spec, "tiny") == 5


def test_a_run_with_nothing_left_says_so_and_starts_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rlhf_trainer import driver

    spec = _spec(tmp_path, **{"algorithm.totalSteps": "20", "checkpoint.export": "never"})
    _saved_by(spec, "tiny", 20)
    monkeypatch.setattr(driver, "connect_ray", lambda *a: pytest.fail("Ray was started"))
    said: list[str] = []
    summary = driver.run(spec, "tiny", metrics_port=0, log=said.append, data=object())  # type: ignore[arg-type]
    assert summary["steps"] == [] and summary["resumed_from"] == 20
    assert said == [summary["message"]]
    assert summary["message"].startswith(f"nothing to do: {spec.checkpoint.path} already holds step 20")
    with pytest.raises(InputError, match=r"model\.reward\.function"):
        other = _spec(tmp_path, **{"algorithm.totalSteps": "40", "model.reward.function": "my_rewards:score"})
        driver.run(other, "tiny", metrics_port=0, log=said.append, data=object())  # type: ignore[arg-type]
