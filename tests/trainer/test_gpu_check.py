"""scripts/gpu_check.py runs where the unit stage runs (`--device cpu --quick`), and fails when it should.

Runs the script as a subprocess with this interpreter, as the device machine would run it, and reads
its `RESULT {json}` line. The GPU half (CUDA IPC, bf16 on CUDA) is only run on a device machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.py"
ROWS = {
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "ppo_token_loss",
    "ppo_decoupled_loss",
    "ppo_clip_higher_dual_clip",
    "ppo_value_loss",
    "ppo_loss",
    "grpo_advantages",
    "grpo_loss",
    "response_logprobs",
}


def run_check(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, dict[str, Any] | None]:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert len(lines) <= 1, proc.stdout
    result = json.loads(lines[0].removeprefix("RESULT ")) if lines else None
    return proc.returncode, proc.stdout + proc.stderr, result


def test_cpu_quick_run_passes_every_check() -> None:
    rc, out, result = run_check("--device", "cpu", "--quick")
    assert rc == 0, out
    assert result is not None, out
    assert result["ok"] is True
    assert result["device"] == "cpu"
    assert result["torch_version"]
    assert result["project_sources"] == str(ROOT / "trainer_image" / "rlhf_trainer")
    assert result["heavy_imports"] == []
    assert set(result["objectives"]) == ROWS
    for name, row in result["objectives"].items():
        assert row["pass"] is True, name
        assert 0.0 <= row["max_scaled_err"] <= row["tol"], name
    channel = result["weight_channel"]
    assert channel["ok"] is True
    assert channel["transport"] == "cpu shared memory (stand-in)"
    assert channel["mismatched"] == []
    assert channel["bytes"] > 1 << 20 and channel["seconds"] > 0 and channel["buckets"] > 1
    assert result["packing_gbps"] > 0 and result["copy_gbps"] > 0
    assert result["packing_vs_copy"] == pytest.approx(result["packing_gbps"] / result["copy_gbps"])
    assert out.count("PASS") == len(ROWS) + 4 and "FAIL" not in out  # the table: every row shown


def test_broken_objectives_and_a_flipped_bit_fail_the_run() -> None:
    """A per-token row and an aggregated loss whose value is near 0 (GRPO's) both fail when shifted."""
    broken = ["kl_k3", "grpo_loss"]
    rc, out, result = run_check(
        "--device", "cpu", "--quick", *(f"--break={name}" for name in [*broken, "weight_channel"])
    )
    assert rc == 1, out
    assert result is not None, out
    assert result["ok"] is False
    assert result["broken"] == [*broken, "weight_channel"]
    for name, row in result["objectives"].items():
        assert row["pass"] is (name not in broken), name
        assert (row["max_scaled_err"] > row["tol"]) is (name in broken), name
    channel = result["weight_channel"]
    assert channel["ok"] is False
    assert channel["mismatched"] == ["model.embed_tokens.weight"]  # the first slot of bucket 0
    assert result["packing"]["ok"] is True


def test_cuda_without_a_gpu_exits_2_with_the_reason() -> None:
    rc, out, result = run_check("--device", "cuda", env={"CUDA_VISIBLE_DEVICES": ""})
    assert rc == 2, out
    assert result is None
    assert "sees no GPU" in out and "--device cpu" in out
