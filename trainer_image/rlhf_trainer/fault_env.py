"""The armed faults of a test run (`RLHF_TRAINER_FAULTS="phase@step,..."`) and their markers, read by
the driver's fault injector and by the workers' own injected hangs (a leaf: the workers import it).

`rank_hang@N` hangs the last rank of the actor group inside step N's actor training, before its first
collective, so the other ranks wait for it in one: the stall-diagnosis tests' stuck rank. It hangs in
`injected_hang` (named so a stack shows it) until the process is killed, at most HANG_SECONDS.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

ENV, DIR_ENV = "RLHF_TRAINER_FAULTS", "RLHF_TRAINER_FAULTS_DIR"
RANK_HANG = "rank_hang"
START_FAILURE = f"{ENV}=start@0: the driver fails at start-up"
HANG_SECONDS = 900.0


class InjectedFault(RuntimeError):
    """A failure the tests asked for (RLHF_TRAINER_FAULTS), not a bug."""


def armed(raw: str | None = None) -> list[tuple[str, int]]:
    """`phase@step,...` as [(phase, step)]; a malformed entry is an error, not silently no fault."""
    raw = os.environ.get(ENV, "") if raw is None else raw
    out = []
    for item in filter(None, (x.strip() for x in raw.split(","))):
        phase, sep, step = item.partition("@")
        if not sep or not step.isdigit():
            raise ValueError(f"{ENV}: {item!r} is not phase@step")
        out.append((phase, int(step)))
    return out


def crash_if_start_armed() -> None:
    """`start@0` as the driver's entrypoint runs it, before its imports: the line main() prints for a
    crash, then exit 1. The lifecycle tests crash dozens of attempts; each skips 3.6 s of torch and Ray."""
    try:
        start = ("start", 0) in armed()
    except ValueError:
        return  # malformed: main() says so, as before
    if start:
        line = f"error: InjectedFault: {START_FAILURE}"
        print(line, file=sys.stderr, flush=True)
        from rlhf_trainer import container_log  # light: `kubectl logs` of a head pod shows it too

        container_log.echo(line)
        raise SystemExit(1)


def marker(phase: str, step: int) -> Path:
    return Path(os.environ.get(DIR_ENV, ".")) / f"{phase}@{step}"


def write_marker(path: Path, record: dict[str, object]) -> None:
    """A fault's marker, whole or not at all: written aside and renamed, so a test that polls for it
    never reads it half written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    aside = path.with_name(f".{path.name}.{os.getpid()}")
    aside.write_text(json.dumps(record) + "\n")
    os.replace(aside, path)


def maybe_hang(step: int | None, role: str, rank: int, world_size: int) -> None:
    """`rank_hang@step`: the actor group's last rank (`role` actor) hangs here, once (its marker), in
    every run where the fault is armed; nothing otherwise."""
    if step is None or role != "actor" or rank != world_size - 1 or (RANK_HANG, step) not in armed():
        return
    mark = marker(RANK_HANG, step)
    if mark.exists():
        return
    write_marker(mark, {"who": f"{role} rank {rank}", "pid": os.getpid()})
    print(f"fault injected: {role} rank {rank} (pid {os.getpid()}) hangs in step {step}", file=sys.stderr)
    sys.stderr.flush()
    injected_hang(HANG_SECONDS)


def injected_hang(seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.2)
    raise InjectedFault(f"{RANK_HANG}: not killed within {seconds:g} s")
