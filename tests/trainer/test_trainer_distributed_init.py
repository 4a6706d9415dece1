"""The trainer's process group starts without DeepSpeed's JIT-built shared-memory op.

A rank killed while DeepSpeed compiled `deepspeed_shm_comm` leaves the torch extensions lock behind,
and every later `deepspeed.init_distributed` on that machine waited on it forever (a CI run hung in
the unit stage this way). Here a stale lock sits in the build directory: `init_distributed` must
return at once, and the directory must show no build.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from testkit.support import free_port

pytestmark = pytest.mark.unit

CHILD = """
import os, sys, time
from rlhf_trainer.workers.deepspeed_utils import init_distributed
t0 = time.monotonic()
init_distributed("gloo")
import torch.distributed as dist
print(f"initialised world {dist.get_world_size()} in {time.monotonic() - t0:.1f} s")
"""


def test_init_distributed_skips_the_shm_op_so_a_stale_build_lock_cannot_hang_it(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "TORCH_EXTENSIONS_DIR": str(tmp_path),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "DS_ACCELERATOR": "cpu",
    }
    build_dir = subprocess.run(
        [sys.executable, "-c", "from torch.utils.cpp_extension import _get_build_directory as d; "
         "print(d('deepspeed_shm_comm', False))"],
        env=env, capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    lock = Path(build_dir) / "lock"
    lock.touch()  # what a rank killed mid-build leaves
    try:
        proc = subprocess.run(
            [sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=90
        )
    except subprocess.TimeoutExpired:
        pytest.fail("init_distributed waited on the stale torch-extensions lock: the shm op was built")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "initialised world 1" in proc.stdout, proc.stdout
    assert sorted(p.name for p in Path(build_dir).iterdir()) == ["lock"], "DeepSpeed started a build"


MLFLOW_CHILD = """
import sys
from rlhf_trainer.workers.deepspeed_utils import import_deepspeed
import_deepspeed()
import deepspeed.autotuning.autotuner as autotuner
print("mlflow imported by deepspeed:", "mlflow" in sys.modules, autotuner.has_mlflow)
import mlflow  # the tracking driver's import still works afterwards
print("mlflow importable:", hasattr(mlflow, "start_run"))
"""


def test_a_rank_imports_deepspeed_without_mlflow_which_stays_importable() -> None:
    """DeepSpeed's autotuner imports mlflow whenever it is installed (the image has it for tracking): 4.4 s
    and ~120 MB in every rank's start-up, measured. The ranks' import hides it; mlflow itself still works."""
    proc = subprocess.run(
        [sys.executable, "-c", MLFLOW_CHILD],
        env={**os.environ, "DS_ACCELERATOR": "cpu"}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "mlflow imported by deepspeed: False False" in proc.stdout, proc.stdout
    assert "mlflow importable: True" in proc.stdout, proc.stdout
