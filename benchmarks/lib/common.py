"""What every benchmark shares: the machine line, medians, the rich table, the RESULT line, a private Ray.

Kept apart from the scripts so `make bench` (which runs benchmarks/*.py) never runs it. A benchmark whose
baseline cannot run raises BaselineUnavailable and exits non-zero without a RESULT line.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[2]
BENCH_RAY_TMP = "/tmp/rlhf-bench-ray"
TINY_DIR = Path(os.environ.get("RLHF_BENCH_TINY", "/tmp/rlhf-bench-tiny"))

console = Console(width=140)


class BaselineUnavailable(RuntimeError):
    """The baseline cannot run here; the benchmark must fail rather than report ours alone."""


def machine() -> dict[str, Any]:
    """nproc, memory, CPU model and date: the context every table needs."""
    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {
        "nproc": os.cpu_count(),
        "mem_gib": round(mem_gib, 1),
        "cpu": cpu,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }


def print_machine() -> None:
    m = machine()
    console.print(
        f"[dim]machine: {m['nproc']} CPUs, {m['mem_gib']} GiB, {m['cpu']}; Python {m['python']}; {m['date']}[/dim]"
    )


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """A readable table; floats get 3 significant digits."""
    t = Table(title=title, title_justify="left")
    for i, c in enumerate(columns):
        t.add_column(c, justify="left" if i == 0 else "right")
    for row in rows:
        t.add_row(*[fmt(v) for v in row])
    console.print(t)


def fmt(v: Any) -> str:
    if isinstance(v, float):
        if v != v:
            return "-"
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    return str(v)


def result(values: dict[str, Any]) -> None:
    """The one machine-readable line a benchmark ends with."""
    print("RESULT " + json.dumps(values, sort_keys=False), flush=True)


def fail(message: str, code: int = 2) -> None:
    """Exit without a RESULT line (the baseline could not run, or a run broke)."""
    console.print(f"[bold red]benchmark failed:[/bold red] {message}")
    sys.exit(code)


def peak_rss_mib() -> float:
    """This process's peak RSS so far (ru_maxrss is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def status_kib(field: str, pid: int | str = "self") -> int:
    """A /proc/PID/status memory field (VmRSS, VmHWM, ...) in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/{pid}/status")


def child_result(values: dict[str, Any]) -> None:
    """A child's measurement, the last line run_child reads."""
    print("CHILD " + json.dumps(values), flush=True)


def tiny_model() -> Path:
    """The offline tiny Llama and prompts (built once with `rlhf make-tiny-model`); returns its directory."""
    if not (TINY_DIR / "model" / "config.json").is_file():
        rlhf = shutil.which("rlhf", path=str(Path(sys.executable).parent)) or "rlhf"
        subprocess.run([rlhf, "make-tiny-model", str(TINY_DIR)], check=True, capture_output=True)
    return TINY_DIR


def start_ray(num_cpus: int | None = None) -> None:
    """A private in-process Ray (own temp dir, no dashboard): never joins or stops anyone else's."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_DEDUP_LOGS", "1")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("RLHF_DEVICE", "cpu")
    import ray

    ray.init(
        address="local",
        num_cpus=num_cpus or max(4, os.cpu_count() or 1),
        include_dashboard=False,
        _temp_dir=BENCH_RAY_TMP,
        log_to_driver=os.environ.get("RLHF_BENCH_WORKER_LOGS", "0") == "1",
        runtime_env={"env_vars": {"RLHF_DEVICE": "cpu", "DS_ACCELERATOR": "cpu"}},
    )


def run_child(
    script: str, way: str, scale: int, flags: dict[str, Any], env: dict[str, str], timeout: float
) -> dict[str, Any]:
    """Run one measurement in a fresh process (clean peak memory); it prints `CHILD {json}` last."""
    cmd = [sys.executable, script, "--child", way, "--scale", str(scale)]
    for k, v in flags.items():
        cmd += [f"--{k.replace('_', '-')}", str(v)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("CHILD ")]
    if proc.returncode or not lines:
        fail(f"{way} x{scale} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    return dict(json.loads(lines[-1][len("CHILD ") :]))
