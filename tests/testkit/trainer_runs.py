"""Helpers of the trainer tests: `rlhf run` as a subprocess and its environment (/metrics watched while it runs),
and the operator's entrypoint (`python -m rlhf_trainer.driver`) told to stop after a given step.

Every run is a real subprocess (Ray driver + DeepSpeed ranks + vLLM engine) on its own embedded Ray
(`RAY_ADDRESS=local`, a private temp dir), so it never joins a Ray head another test suite runs.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from testkit.support import MetricsWatcher

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "rlhfjob-tiny.yaml"
# The tiny task with the critic-free estimators instead of PPO (gae).
GRPO = ["algorithm.advantageEstimator=grpo", "model.critic=null", "trainer.critic=null"]
REINFORCE_PP = ["algorithm.advantageEstimator=reinforce_pp", "model.critic=null", "trainer.critic=null"]
# One actor+reference rank instead of the example's two: for runs whose proof does not involve ZeRO-3
# across ranks (a rank's start-up is about 10 CPU-seconds of the 2 cores; the runs that shard across
# ranks are test_trainer_run.py's GRPO, PPO and preemption runs).
ONE_RANK = ["trainer.actor.gpusPerNode=1"]


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
        # No GPU here: the job's GPUs are Ray's logical ones, computed on with CPU kernels (named stand-in).
        "RLHF_GPU_STANDIN": "cpu",
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
    cwd: Path | None = None,
) -> Run:
    """`rlhf run` to its end; `cwd`: where it runs (a spec's relative paths resolve there)."""
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
        cwd=cwd,
    )
    seconds = time.monotonic() - t0
    scrapes = watcher.stop() if watcher else []
    data = json.loads(summary.read_text()) if summary.exists() else None
    return Run(proc.returncode, proc.stderr, seconds, data, scrapes)


def spec_of(spec: Path, sets: list[str]) -> dict[str, Any]:
    """The manifest's spec with `--set`-style overrides applied, as the operator passes it to the driver."""
    from rlhf_trainer.cli import apply_overrides

    return dict(apply_overrides(yaml.safe_load(spec.read_text()), sets)["spec"])


@dataclass
class Stopped:
    """A driver run that was told to stop: its exit, its output and the JSON step lines it printed."""

    returncode: int
    stdout: str
    stderr: str
    reports: list[dict[str, Any]]
    summary: dict[str, Any] | None
    seconds: float


def run_driver_and_stop(
    spec: dict[str, Any],
    job: str,
    tmp: Path,
    ray_tmp: Path,
    procs: list[subprocess.Popen[str]],
    *,
    after_step: int,
    stop: Callable[[int], None],
    during: Callable[[int], None] | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 600,
) -> Stopped:
    """`python -m rlhf_trainer.driver` on `spec`; `stop(pid)` is called 1 s after the driver printed
    step `after_step`'s line (its step-boundary check has passed, so the stop lands in the next step), then
    `during(pid)` if given, while the driver still runs; returns once the driver has exited."""
    summary = tmp / f"summary-{time.monotonic_ns()}.json"
    stderr_path = tmp / f"driver-{time.monotonic_ns()}.stderr"
    cmd = [sys.executable, "-m", "rlhf_trainer.driver", "--job-name", job, "--spec-env", "RLHF_SPEC_JSON",
           "--summary-json", str(summary)]  # fmt: skip
    full_env = {
        **run_env(ray_tmp),
        "RLHF_SPEC_JSON": json.dumps(spec),
        "RLHF_METRICS_PORT": "0",
        **(env or {}),
    }
    t0 = time.monotonic()
    with stderr_path.open("w") as err:
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=full_env, start_new_session=True
        )
    procs.append(proc)
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    out: list[str] = []
    reports: list[dict[str, Any]] = []
    stopped = False
    deadline = t0 + timeout
    while True:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise AssertionError(f"the driver did not end in {timeout} s: {''.join(out)[-2000:]}") from None
        if line is None:
            break
        out.append(line)
        if line.startswith("{"):
            reports.append(json.loads(line))
            if reports[-1].get("step") == after_step and not stopped:
                time.sleep(1.0)
                stop(proc.pid)
                stopped = True
                if during is not None:
                    during(proc.pid)
    proc.wait(timeout=120)
    seconds = time.monotonic() - t0
    data = json.loads(summary.read_text()) if summary.exists() else None
    return Stopped(proc.returncode, "".join(out), stderr_path.read_text(), reports, data, seconds)


def sigterm(pid: int) -> None:
    os.kill(pid, signal.SIGTERM)
