"""Atomic checkpoints: every part is written into a hidden temp directory, which is renamed into place.

Owns the directory layout (`step-00000010/` with `trainer_state.json` written last), rotation (keep last N)
and finding the newest *complete* checkpoint. A crash leaves at most a `.tmp-*` directory, which resume
ignores and the next start removes. What goes inside (DeepSpeed shards) is the workers' business.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any

STATE_FILE = "trainer_state.json"
_STEP_DIR = re.compile(r"^step-(\d{8})$")


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


class CheckpointStore:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def begin(self, step: int) -> Path:
        """A fresh temp directory for step's checkpoint (on the same filesystem as the final one)."""
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".tmp-{step_dir_name(step)}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        return tmp

    def commit(self, tmp: Path, step: int, state: dict[str, Any]) -> Path:
        """Write the trainer state last, fsync, then rename the directory into place (atomic on POSIX)."""
        state = {**state, "step": step, "complete": True}
        state_path = tmp / STATE_FILE
        with state_path.open("w") as f:
            json.dump(state, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        final = self.root / step_dir_name(step)
        if final.exists():  # a re-run of the same step after a resume: replace it
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(self.root)
        return final

    def abort(self, tmp: Path) -> None:
        shutil.rmtree(tmp, ignore_errors=True)

    def complete(self) -> list[tuple[int, Path]]:
        """Complete checkpoints, oldest first."""
        if not self.root.is_dir():
            return []
        out = []
        for p in self.root.iterdir():
            m = _STEP_DIR.match(p.name)
            if m and p.is_dir() and _is_complete(p):
                out.append((int(m.group(1)), p))
        return sorted(out)

    def latest(self) -> tuple[int, Path, dict[str, Any]] | None:
        found = self.complete()
        if not found:
            return None
        step, path = found[-1]
        return step, path, json.loads((path / STATE_FILE).read_text())

    def rotate(self, keep_last: int) -> list[Path]:
        found = self.complete()
        removed = []
        for _, path in found[: max(0, len(found) - keep_last)]:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        return removed

    def remove_partial(self) -> list[Path]:
        """Delete leftovers of interrupted writes (temp dirs, step dirs without a state file)."""
        if not self.root.is_dir():
            return []
        removed = []
        for p in self.root.iterdir():
            if p.is_dir() and (
                p.name.startswith(".tmp-") or (_STEP_DIR.match(p.name) and not _is_complete(p))
            ):
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p)
        return removed


def _is_complete(path: Path) -> bool:
    try:
        return bool(json.loads((path / STATE_FILE).read_text()).get("complete"))
    except (OSError, ValueError):
        return False


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
