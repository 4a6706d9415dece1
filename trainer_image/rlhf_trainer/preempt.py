"""`python -m rlhf_trainer.preempt`: the head container's preStop hook, which stops the trainer driver.

The driver runs as a child of Ray's job supervisor, not as the container's PID 1, so the kubelet's SIGTERM
never reaches it. This hook finds the driver processes in the container (/proc/*/cmdline), sends each
SIGTERM (the driver then saves or keeps a checkpoint at its next step boundary: stop.py), waits until they
exit or the budget passes, and exits 0 whatever happened: it must never hang past the budget.
Its lines also go to the container's log (a hook's own output is shown only when it fails). Never kills:
SIGKILL is the kubelet's, at the grace period's end.
"""

from __future__ import annotations

import argparse
import itertools
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

from rlhf_api.spec import RunPolicySpec

from rlhf_trainer import container_log
from rlhf_trainer.stop import stop_budget

DRIVER_MODULE = "rlhf_trainer.driver"
DEFAULT_GRACE_SECONDS: int = RunPolicySpec.model_fields["termination_grace_period_seconds"].default
POLL_SECONDS = 0.2


def is_driver(argv: list[str], job: str | None = None) -> bool:
    """A trainer driver: `python -m rlhf_trainer.driver ...` (or .../rlhf_trainer/driver.py). An argument
    that only contains the name, as the `sh -c "python -m rlhf_trainer.driver ..."` Ray's job supervisor
    starts it with, is not one: stopping that shell would orphan the driver. With `job`, only the driver
    started with `--job-name job`."""
    if not any(a == DRIVER_MODULE or a.endswith("rlhf_trainer/driver.py") for a in argv):
        return False
    if job is None:
        return True
    pairs = itertools.pairwise(argv)
    return f"--job-name={job}" in argv or any(a == "--job-name" and b == job for a, b in pairs)


def find_drivers(proc: Path = Path("/proc"), job: str | None = None) -> dict[int, str]:
    """{pid: command line} of the live driver processes under `proc`, never this process."""
    found = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            raw = (entry / "cmdline").read_bytes()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        argv = [a.decode(errors="replace") for a in raw.rstrip(b"\0").split(b"\0")]
        if is_driver(argv, job) and alive(int(entry.name), proc):
            found[int(entry.name)] = " ".join(argv)
    return found


def alive(pid: int, proc: Path = Path("/proc")) -> bool:
    """Running: it exists and is not a zombie (an exited child its parent has not reaped yet)."""
    try:
        stat = (proc / str(pid) / "stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[:1] != ["Z"]


def stop_drivers(
    budget: float,
    job: str | None = None,
    proc: Path = Path("/proc"),
    say: Callable[[str], None] = print,
) -> list[int]:
    """SIGTERM every driver, then wait for them until `budget` seconds have passed; returns the pids
    still running then ([]: all exited)."""
    t0 = time.monotonic()
    drivers = find_drivers(proc, job)
    if not drivers:
        say("preempt: no trainer driver is running")
        return []
    for pid, cmdline in drivers.items():
        try:
            os.kill(pid, signal.SIGTERM)
            say(f"preempt: sent SIGTERM to the driver, pid {pid}: {cmdline}")
        except ProcessLookupError:
            pass
    running = [pid for pid in drivers if alive(pid, proc)]
    say(f"preempt: waiting up to {budget:.0f} s for {len(running)} driver(s) to save and exit")
    while running and time.monotonic() - t0 < budget:
        time.sleep(min(POLL_SECONDS, max(0.0, budget - (time.monotonic() - t0))))
        running = [pid for pid in running if alive(pid, proc)]
    took = time.monotonic() - t0
    if running:
        say(f"preempt: driver(s) {running} still running after {took:.1f} s (the budget): leaving them")
    else:
        say(f"preempt: every driver exited after {took:.1f} s")
    return running


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rlhf_trainer.preempt", description=__doc__)
    p.add_argument(
        "--budget",
        type=float,
        help="seconds to wait (default: $RLHF_STOP_BUDGET_SECONDS, else the default grace period less the margin)",
    )
    p.add_argument("--job", help="only the driver started with --job-name JOB")
    args = p.parse_args(argv)
    budget = args.budget if args.budget is not None else stop_budget(os.environ, DEFAULT_GRACE_SECONDS)
    try:
        stop_drivers(max(0.0, budget), args.job, say=_say)
    except Exception as e:  # a preStop hook that fails only makes an Event; say why, exit 0 anyway
        _say(f"preempt: error: {type(e).__name__}: {e}")
    return 0


def _say(line: str) -> None:
    print(line, flush=True)
    container_log.echo(line)


if __name__ == "__main__":
    raise SystemExit(main())
