"""A real ZeRO-3 checkpoint of a model directory, written as the trainer writes one (export's benchmark and test).

Owns running the trainer's own `ModelRank` (the actor alone: DeepSpeed ZeRO-3, 1 rank, gloo, CPU) in a fresh
process and committing its `save` through `CheckpointStore`, so the layout is the trainer's
(`step-NNNNNNNN/actor/*_model_states.pt, *_optim_states.pt`, `trainer_state.json` naming the base model).
Must not export: that is what its callers measure.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def write(model_dir: Path, root: Path, step: int = 1, timeout: float = 1200) -> Path:
    """The checkpoint of step `step` under `root` for the model in `model_dir`; returns its directory.

    Runs in a child process: DeepSpeed initialises torch.distributed, which must not leak into the caller."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "RLHF_DEVICE": "cpu"}
    cmd = [sys.executable, __file__, str(model_dir), str(root), str(step)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if proc.returncode:
        raise RuntimeError(f"writing the checkpoint failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return root / f"step-{step:08d}"


def _main(model_dir: str, root: str, step: int) -> None:
    from rlhf_trainer.checkpoint import CheckpointStore
    from rlhf_trainer.workers.rank import ModelRank, free_port

    settings = {
        "path": model_dir,
        "zero_stage": 3,
        "bf16": False,
        "offload": False,
        "gradient_checkpointing": False,
        "pad_id": 0,
        "lr": 1e-5,
        "lr_scheduler": "constant",
        "lr_warmup_steps": 0,
        "total_steps": 10,
        "train_micro_batch": 1,
        "grad_accum": 1,
        "temperature": 1.0,
    }
    rank = ModelRank("actor", ["actor"], 0, 1, "cpu", os.cpu_count() or 1)
    rank.setup("127.0.0.1", free_port(), {"actor": settings})
    store = CheckpointStore(root)
    tmp = store.begin(step)
    rank.save(str(tmp))  # what Checkpointer.save has every rank do
    store.commit(tmp, step, {"job": "export-check", "identity": {"model.actor": model_dir}})


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
