"""What the run samples and how it summarises: a progress line while a wait lasts, a process's CPU
seconds and peak memory from /proc, percentiles. No API calls.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from lib import common

PROGRESS_EVERY = 10.0


@contextlib.contextmanager
def progress(describe: Callable[[], str], every: float = PROGRESS_EVERY) -> Iterator[None]:
    """Print describe() every `every` seconds while the block runs, so a long run is never silent."""
    stop = threading.Event()
    t0 = time.monotonic()

    def loop() -> None:
        while not stop.wait(every):
            common.console.print(f"[dim]  +{time.monotonic() - t0:4.0f}s {describe()}[/dim]")

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """user+system CPU seconds of each process so far (/proc/<pid>/stat); this process as `client`."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for name, pid in {**pids, "client": os.getpid()}.items():
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            out[name] = (int(fields[11]) + int(fields[12])) / tick
    return out


def rss_mib(pid: int, field: str = "VmHWM") -> float:
    """A process's peak resident memory so far (VmHWM in /proc/<pid>/status), or another field such as
    VmRSS (now), MiB; NaN if unreadable."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def percentile(xs: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    s = sorted(xs)
    if not s:
        return float("nan")
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)
