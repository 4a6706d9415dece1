"""A process's Python stacks on demand, from outside, with no privilege: `faulthandler` on SIGUSR2.

Why not py-spy: it needs ptrace, which the job's pods do not grant (every capability dropped, the
runtime's seccomp profile). faulthandler's handler is C code that writes every thread's Python stack
to a file the process opened at start, so it answers even when the process is stuck in C code holding
the GIL (a collective, a socket read). Only a process that cannot run at all (stopped, or in
uninterruptible sleep) cannot answer: the collector reports it as not answering.

Each process registers itself in a directory of its node (`REGISTRY_ENV`, default `/tmp/rlhf-stacks`):
`<pid>.json` says who it is, `<pid>.stack` receives its dumps (opened for append, so a collector may
truncate it before asking).
"""

from __future__ import annotations

import faulthandler
import json
import os
import re
import signal
import socket
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rlhf_api.constants import JOB_NAME_ENV, NAMESPACE_ENV

REGISTRY_ENV = "RLHF_STACKS_DIR"
DEFAULT_REGISTRY = "/tmp/rlhf-stacks"
SIGNAL = signal.SIGUSR2  # Ray's own dashboard agent dumps on it too; nothing else of ours uses it

_armed: list[Any] = []  # the open dump files, kept alive for the process's life


@dataclass(frozen=True)
class Registration:
    """Who a registered process is: `who` as a person reads it ("actor rank 1"), its role and rank."""

    who: str
    role: str
    rank: int | None
    pid: int
    pod: str
    node_id: str
    main_thread: int
    start_ticks: int  # /proc/<pid>/stat's start time: a reused pid is not the registered process
    job: str = ""  # namespace/name of its RLHFJob (job_key), '' when unknown

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Registration:
        return cls(**json.loads(text))


def job_key() -> str:
    """`namespace/name` of the RLHFJob this process belongs to (the operator's runtime env), or ''."""
    name, namespace = os.environ.get(JOB_NAME_ENV, ""), os.environ.get(NAMESPACE_ENV, "")
    return f"{namespace}/{name}" if name and namespace else ""


def registry() -> Path:
    return Path(os.environ.get(REGISTRY_ENV) or DEFAULT_REGISTRY)


def start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot, or None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2 :].split()[19])


def arm(who: str, role: str, rank: int | None = None, node_id: str = "") -> Registration | None:
    """Register this process and install the dump handler; None (and nothing armed) on a platform
    without /proc or when the registry cannot be written: a snapshot then misses this process, the
    job runs on. Idempotent per process."""
    pid = os.getpid()
    ticks = start_ticks(pid)
    if ticks is None:
        return None
    if not node_id:
        node_id = _ray_node_id()
    reg = Registration(
        who=who,
        role=role,
        rank=rank,
        pid=pid,
        pod=os.environ.get("HOSTNAME") or socket.gethostname(),
        node_id=node_id,
        main_thread=threading.main_thread().ident or 0,
        start_ticks=ticks,
        job=job_key(),
    )
    try:
        root = registry()
        root.mkdir(parents=True, exist_ok=True)
        out = open(root / f"{pid}.stack", "a", buffering=1)  # noqa: SIM115 (open for the process's life)
        faulthandler.register(SIGNAL, file=out, all_threads=True, chain=False)
        _armed[:] = [out]
        tmp = root / f".{pid}.json"
        tmp.write_text(reg.to_json())
        tmp.replace(root / f"{pid}.json")
    except OSError:
        return None
    return reg


def _ray_node_id() -> str:
    try:
        import ray

        return str(ray.get_runtime_context().get_node_id()) if ray.is_initialized() else ""
    except Exception:  # a process outside Ray (a unit test): no node id
        return ""


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    func: str


@dataclass(frozen=True)
class ThreadStack:
    ident: int
    current: bool  # the thread that ran the handler
    frames: list[Frame] = field(default_factory=list)  # innermost first


_THREAD = re.compile(r"^(Current thread|Thread) 0x([0-9a-fA-F]+) \(most recent call first\):")
_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.+)$')


def parse(text: str) -> list[ThreadStack]:
    """The threads of one faulthandler dump (the last one, if the file holds several)."""
    threads: list[ThreadStack] = []
    for raw in text.splitlines():
        if m := _THREAD.match(raw):
            if any(t.ident == int(m.group(2), 16) for t in threads):
                threads = []  # a second dump starts: keep only the latest
            threads.append(ThreadStack(int(m.group(2), 16), m.group(1) == "Current thread"))
        elif (m := _FRAME.match(raw)) and threads:
            threads[-1].frames.append(Frame(m.group(1), int(m.group(2)), m.group(3)))
    return threads
