"""The head container's preStop hook (`python -m rlhf_trainer.preempt`) against a real process standing in
for the driver: found by its command line, sent SIGTERM, waited for, and never waited for past the budget.

The stand-in's command line holds `rlhf_trainer.driver` and a job name of this test only; the hook is run
with `--job` so it can never signal a real driver another test runs on this machine (the unfiltered search
is checked without signalling).
"""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from rlhf_trainer.preempt import find_drivers, is_driver

pytestmark = pytest.mark.unit

# Traps SIGTERM (or ignores it), says it is ready, and on SIGTERM takes `delay` s (a save) before it writes
# `done` and exits 143.
STAND_IN = """
import signal, sys, time
from pathlib import Path
ready, done, mode, delay = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], float(sys.argv[4])
def on_term(signum, frame):
    time.sleep(delay)
    done.write_text("saved")
    sys.exit(143)
signal.signal(signal.SIGTERM, on_term if mode == "trap" else signal.SIG_IGN)
ready.write_text("ready")
time.sleep(120)
"""


@pytest.fixture
def stand_in(tmp_path: Path) -> Iterator[tuple[Path, str, list[subprocess.Popen[bytes]]]]:
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    procs: list[subprocess.Popen[bytes]] = []
    yield script, f"preempt-test-{uuid.uuid4().hex[:8]}", procs
    for p in procs:
        p.kill()
        p.wait()


def _start_stand_in(
    stand_in: tuple[Path, str, list[subprocess.Popen[bytes]]], tmp: Path, mode: str, delay: float
) -> tuple[subprocess.Popen[bytes], Path]:
    script, job, procs = stand_in
    ready, done = tmp / f"ready-{mode}", tmp / f"done-{mode}"
    argv = [sys.executable, str(script), str(ready), str(done), mode, str(delay)]
    proc = subprocess.Popen([*argv, "-m", "rlhf_trainer.driver", "--job-name", job])
    procs.append(proc)
    deadline = time.monotonic() + 10
    while not ready.exists():
        assert time.monotonic() < deadline, "the stand-in never started"
        time.sleep(0.02)
    return proc, done


def hook(job: str, budget: float) -> tuple[subprocess.CompletedProcess[str], float]:
    t0 = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "rlhf_trainer.preempt", "--budget", str(budget), "--job", job],
        capture_output=True,
        text=True,
        timeout=budget + 30,
    )
    return out, time.monotonic() - t0


def test_the_hook_signals_the_driver_and_waits_until_it_exited(
    stand_in: tuple[Path, str, list[subprocess.Popen[bytes]]], tmp_path: Path
) -> None:
    proc, done = _start_stand_in(stand_in, tmp_path, "trap", delay=1.0)
    job = stand_in[1]
    assert proc.pid in find_drivers()  # found by the hook's own search, unfiltered (nothing is signalled)
    assert list(find_drivers(job=job)) == [proc.pid]
    out, seconds = hook(job, budget=20)
    assert out.returncode == 0, out.stderr
    # signalled: the stand-in's SIGTERM handler ran; waited for: the hook returned only after it exited
    assert done.read_text() == "saved"
    assert proc.poll() == 143  # exited (the hook saw it as a zombie: this test, not the hook, reaps it)
    assert 1.0 <= seconds < 20, seconds
    assert f"sent SIGTERM to the driver, pid {proc.pid}" in out.stdout, out.stdout
    assert "every driver exited after" in out.stdout, out.stdout


def test_the_hook_returns_within_its_budget_when_the_driver_ignores_sigterm(
    stand_in: tuple[Path, str, list[subprocess.Popen[bytes]]], tmp_path: Path
) -> None:
    proc, done = _start_stand_in(stand_in, tmp_path, "ignore", delay=0.0)
    out, seconds = hook(stand_in[1], budget=2)
    assert out.returncode == 0, out.stderr
    assert 2 <= seconds < 2 + 5, seconds  # the budget, plus the interpreter's start
    assert proc.poll() is None and not done.exists()  # it never kills: SIGKILL is the kubelet's
    assert f"driver(s) [{proc.pid}] still running after" in out.stdout, out.stdout


def test_the_hook_exits_0_at_once_when_no_driver_runs() -> None:
    out, seconds = hook(f"no-such-job-{uuid.uuid4().hex[:8]}", budget=20)
    assert out.returncode == 0 and "no trainer driver is running" in out.stdout, out.stdout
    assert seconds < 10


@pytest.mark.parametrize(
    ("argv", "driver"),
    [
        (["python", "-m", "rlhf_trainer.driver", "--job-name", "a", "--spec-env", "RLHF_SPEC_JSON"], True),
        (["/usr/bin/python3", "/app/rlhf_trainer/driver.py"], True),
        # Ray's job supervisor starts the entrypoint through a shell: stopping it would orphan the driver
        (["/bin/sh", "-c", "python -m rlhf_trainer.driver --job-name a --spec-env RLHF_SPEC_JSON"], False),
        (["python", "-m", "rlhf_trainer.preempt"], False),
        (["python", "-m", "rlhf_trainer.cli", "run", "job.yaml"], False),
    ],
)
def test_what_counts_as_a_driver(argv: list[str], driver: bool) -> None:
    assert is_driver(argv) is driver


def test_job_filter() -> None:
    argv = ["python", "-m", "rlhf_trainer.driver", "--job-name", "a"]
    assert is_driver(argv, "a") and not is_driver(argv, "b")
    assert is_driver(["python", "-m", "rlhf_trainer.driver", "--job-name=a"], "a")


def test_find_drivers_reads_proc_and_skips_zombies(tmp_path: Path) -> None:
    def fake(pid: int, argv: list[str], state: str = "S") -> None:
        d = tmp_path / str(pid)
        d.mkdir()
        (d / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
        (d / "stat").write_text(f"{pid} (python (x)) {state} 1 1 1 0 -1\n")

    fake(100, ["python", "-m", "rlhf_trainer.driver", "--job-name", "a"])
    fake(101, ["python", "-m", "rlhf_trainer.driver", "--job-name", "b"], state="Z")
    fake(102, ["/bin/sh", "-c", "python -m rlhf_trainer.driver --job-name a"])
    (tmp_path / "self").mkdir()
    assert find_drivers(tmp_path) == {100: "python -m rlhf_trainer.driver --job-name a"}
