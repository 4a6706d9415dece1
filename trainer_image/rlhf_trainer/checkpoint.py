"""Atomic checkpoints: every part is written into a hidden temp directory, which is renamed into place.

Owns the directory layout (`step-00000010/` with `trainer_state.json` written last), rotation (keep last N),
finding the newest *complete* checkpoint (`CheckpointStore`) and the driver's save/resume of a run
(`Checkpointer`). A crash leaves at most a `.tmp-*` directory, which resume ignores and the next start
removes. What goes inside (DeepSpeed shards) is the workers' business.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from rlhf_api.spec import RLHFJobSpec

from rlhf_trainer.config import InputError
from rlhf_trainer.data import PromptDataset
from rlhf_trainer.groups import RayGroup
from rlhf_trainer.metrics import TrainerExporter

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


# What a checkpoint's weights and data position depend on. Resuming with any of these changed would
# silently train another job on this one's state. totalSteps is left out: extending a run is a resume.
_IDENTITY_SECTIONS = {"model", "algorithm", "data"}


def training_identity(spec: RLHFJobSpec) -> dict[str, Any]:
    """The spec's training-relevant fields, flattened: {"model.actor": ..., "algorithm.kind": ...}."""
    dumped = spec.model_dump(mode="json", by_alias=True, include=_IDENTITY_SECTIONS)
    dumped.get("algorithm", {}).pop("totalSteps", None)
    flat: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and value:
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        else:
            flat[prefix] = value

    walk("", dumped)
    return flat


def identity_digest(fields: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def check_resumable(state: dict[str, Any], path: Path, spec: RLHFJobSpec, job: str) -> None:
    """Refuse to resume another run's checkpoint (another job, or a changed training spec).

    Raises InputError naming both sides and the ways out; `checkpoint.resume: force` skips the check.
    A checkpoint written before identities were recorded is accepted as it is.
    """
    if spec.checkpoint.resume == "force":
        return
    diffs = []
    if state.get("job") not in (None, job):
        diffs.append(f"job {state['job']!r} (this run: {job!r})")
    saved = state.get("identity")
    if isinstance(saved, dict) and identity_digest(saved) != identity_digest(now := training_identity(spec)):
        for key in sorted(set(saved) | set(now)):
            if saved.get(key) != now.get(key):
                diffs.append(f"{key}: {_short(saved.get(key))} (this run: {_short(now.get(key))})")
    if diffs:
        shown = "; ".join(diffs[:6]) + (f"; and {len(diffs) - 6} more" if len(diffs) > 6 else "")
        raise InputError(
            f"checkpoint.path {path.parent}: the newest checkpoint ({path.name}) is another run's: {shown}. "
            "Use another checkpoint.path, or set checkpoint.resume: never to start fresh there "
            "(`rlhf run --resume never`; its checkpoints are then replaced), or checkpoint.resume: force "
            "to resume from it anyway (`--resume force`)"
        )


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def resume_point(spec: RLHFJobSpec, job: str) -> int:
    """The step of the checkpoint `Checkpointer.resume` will load (0: a fresh start); reads no weights.

    Raises InputError if that checkpoint is another run's (`check_resumable`), before anything starts.
    """
    if not spec.checkpoint.path or spec.checkpoint.resume == "never":
        return 0
    latest = CheckpointStore(spec.checkpoint.path).latest()
    if latest is None:
        return 0
    step, path, state = latest
    check_resumable(state, path, spec, job)
    return step


@dataclass
class Checkpointer:
    """Saves the run (every trained rank's shards, data position, digests) when due, and resumes it.

    `on_written(step)` runs once every rank has written its shard, before the commit (fault injection).
    """

    spec: RLHFJobSpec
    job: str
    data: PromptDataset
    groups: Sequence[RayGroup]
    metrics: TrainerExporter
    log: Callable[[str], None]
    on_written: Callable[[int], None] | None = None
    written: list[str] = field(default_factory=list)  # paths of the checkpoints this run wrote
    resume_info: dict[str, Any] = field(default_factory=dict)  # what `resume` loaded ({}: a fresh start)
    last_step: int = 0  # the newest checkpoint's step: written by this run, or resumed from (0: none)
    save_seconds: float | None = None  # how long this run's last save took (None: it has not saved)
    # the data position after the last trained batch, when the loop drew a batch ahead (async RL); None:
    # the dataset's own position
    trained_position: dict[str, Any] | None = None
    # the objective's state across steps (loop.ObjectiveState: adaptive KL, running score moments);
    # saved with each checkpoint, and what `resume` loaded
    algorithm_state: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.store = CheckpointStore(self.spec.checkpoint.path) if self.spec.checkpoint.path else None

    def due(self, step: int) -> bool:
        return self.store is not None and (
            step % self.spec.checkpoint.interval_steps == 0 or step == self.spec.algorithm.total_steps
        )

    def save(self, step: int, history: Sequence[dict[str, Any]], rollout_digest: str = "") -> str:
        """Write step's checkpoint atomically, then rotate; `history`: the run's step reports, as dicts;
        `rollout_digest`: the step's rollout tokens (a resumed run that samples the same shows it)."""
        assert self.store is not None
        t0 = time.monotonic()
        tmp = self.store.begin(step)
        try:
            ray.get([ref for g in self.groups for ref in g.call("save", str(tmp))])
            if self.on_written is not None:
                self.on_written(step)
            state = {
                "data": self.trained_position or self.data.position.to_dict(),
                "state_digests": self.state_digests(),
                "job": self.job,
                "identity": training_identity(self.spec),
                "history": list(history[-50:]),
                "algorithm_state": self.algorithm_state,
                "rollout_digest": rollout_digest,
                "time": time.time(),
                # the shards' writing (the commit after it is one small file and a rename): a resumed run
                # estimates its first save from it (stop.estimate_save_seconds)
                "save_seconds": round(time.monotonic() - t0, 3),
            }
            final = self.store.commit(tmp, step, state)
        except BaseException:
            self.store.abort(tmp)
            raise
        self.store.rotate(self.spec.checkpoint.keep_last)
        self.written.append(str(final))
        self.last_step, self.save_seconds = step, time.monotonic() - t0
        self.metrics.checkpointed(step)
        return str(final)

    def state_digests(self) -> dict[str, dict[str, float]]:
        """{"<group>/<rank>/<role>": digest} of every trained model's weights, optimizer and schedule."""
        out: dict[str, dict[str, float]] = {}
        for g in self.groups:
            for rank, digests in enumerate(ray.get(g.call("state_digests"))):
                for role, digest in digests.items():
                    out[f"{g.name}/{rank}/{role}"] = digest
        return out

    def resume(self) -> int:
        """Load the newest complete checkpoint (resume: auto or force); returns the next step to run."""
        if self.store is None or self.spec.checkpoint.resume == "never":
            return 1
        for p in self.store.remove_partial():
            self.log(f"removed partial checkpoint {p}")
        latest = self.store.latest()
        if latest is None:
            return 1
        step, path, state = latest
        check_resumable(state, path, self.spec, self.job)
        ray.get([ref for g in self.groups for ref in g.call("load", str(path))])
        self.data.restore(state["data"])
        self.algorithm_state = dict(state.get("algorithm_state") or {})
        self.resume_info = {
            "from_step": step,
            "path": str(path),
            "data": state["data"],
            "state_digests_saved": state.get("state_digests"),
            "state_digests_loaded": self.state_digests(),
            "save_seconds": state.get("save_seconds"),
        }
        self.last_step = step
        self.metrics.checkpointed(step)
        self.log(f"resumed from {path} (step {step}); data position {state['data']}")
        return step + 1


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
