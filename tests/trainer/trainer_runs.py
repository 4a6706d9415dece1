"""Helpers of the trainer tests: `rlhf run` as a subprocess and its environment (/metrics watched while it runs).

Every run is a real subprocess (Ray driver + DeepSpeed ranks + vLLM engine) on its own embedded Ray
(`RAY_ADDRESS=local`, a private temp dir), so it never joins a Ray head another test suite runs.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from support import MetricsWatcher

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "rlhfjob-tiny.yaml"
# The tiny task with the critic-free estimators instead of PPO (gae).
GRPO = ["algorithm.advantageEstimator=grpo", "model.critic=null", "trainer.critic=null"]
REINFORCE_PP = ["algorithm.advantageEstimator=reinforce_pp", "model.critic=null", "trainer.critic=null"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tiny_sets(tiny: Path, ckpt: Path) -> list[str]:
    return [
        f"model.actor={tiny}/model",
        f"model.critic={tiny}/model",
        f"data.prompts={tiny}/prompts.jsonl",
        f"checkpoint.path={ckpt}",
    ]


def cli_cmd(
    spec: Path,
    sets: list[str],
    summary: Path | None = None,
    steps: int | None = None,
    port: int | None = None,
) -> list[str]:
    """`rlhf run`; with a port, /metrics is served there (monitoring.metricsPort), else not at all."""
    cmd = [sys.executable, "-m", "rlhf_trainer.cli", str(spec), "--quiet"]
    cmd += ["--set", f"monitoring.metricsPort={port}"] if port else ["--metrics-port", "0"]
    for s in sets:
        cmd += ["--set", s]
    if summary is not None:
        cmd += ["--summary-json", str(summary)]
    if steps is not None:
        cmd += ["--steps", str(steps)]
    return cmd


def run_env(ray_tmp: Path) -> dict[str, str]:
    """A fresh embedded Ray per run (never a running head), its files under ray_tmp."""
    return {
        **os.environ,
        "RAY_ADDRESS": "local",
        "RAY_TMPDIR": str(ray_tmp),
        "RLHF_WORKER_LOGS": "0",
        "PYTHONUNBUFFERED": "1",
    }


@dataclass
class Run:
    returncode: int
    stderr: str
    seconds: float
    summary: dict[str, Any] | None
    scrapes: list[str] = field(default_factory=list)


def run_cli(
    spec: Path,
    sets: list[str],
    tmp: Path,
    ray_tmp: Path,
    *,
    steps: int | None = None,
    port: int | None = None,
    timeout: float = 900,
    env: dict[str, str] | None = None,
) -> Run:
    summary = tmp / f"summary-{time.monotonic_ns()}.json"
    watcher = MetricsWatcher(f"http://127.0.0.1:{port}/metrics") if port else None
    t0 = time.monotonic()
    proc = subprocess.run(
        cli_cmd(spec, sets, summary, steps, port),
        capture_output=True,
        text=True,
        env={**run_env(ray_tmp), **(env or {})},
        timeout=timeout,
        start_new_session=True,
    )
    seconds = time.monotonic() - t0
    scrapes = watcher.stop() if watcher else []
    data = json.loads(summary.read_text()) if summary.exists() else None
    return Run(proc.returncode, proc.stderr, seconds, data, scrapes)
