"""Atomic checkpoints, rotation and resume selection (rlhf_trainer.checkpoint)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rlhf_trainer.checkpoint import STATE_FILE, CheckpointStore

pytestmark = pytest.mark.unit


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
