"""Where a process's heap was at its peak: memray's high-water-mark records grouped by call site.

`memray_command` wraps a Python command so it runs under `memray run --aggregate`; `top_sites` groups the
records of the capture it writes. Only the benchmarks use this, and only when asked (memray is a PyPI
package the project does not install).
"""

from __future__ import annotations

import sysconfig
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

Frame = tuple[str, str, int]  # (function, file, line), as memray gives them, innermost first

_STDLIB = sysconfig.get_paths()["stdlib"]


def memray_command(python: str, module: str, args: Sequence[str], capture: Path) -> list[str]:
    """`python -m module args` under memray: every allocation, Python objects included, is tracked, and
    the capture keeps the records live at the heap's peak (aggregated: a small file, written at exit)."""
    return [
        python,
        *("-m", "memray", "run", "--aggregate", "--trace-python-allocators", "--force"),
        *("-o", str(capture), "-m", module, *args),
    ]


def _short(path: str) -> str:
    for marker in ("site-packages/", "/operator/"):
        at = path.rfind(marker)
        if at >= 0:
            return path[at + len(marker) :]
    if path.startswith(_STDLIB):
        return path[len(_STDLIB) + 1 :]
    return path


def _library(path: str) -> bool:
    """The standard library (json, asyncio, copy, ...): the how of an allocation, not its owner."""
    return path.startswith("<frozen") or (path.startswith(_STDLIB) and "site-packages" not in path)


@dataclass(frozen=True)
class Site:
    """Bytes live at the peak from one call site: where they were allocated, and the owning frames."""

    size: int
    count: int
    allocated_in: str
    owners: tuple[str, ...]


def top_sites(records: Iterable[tuple[int, int, Sequence[Frame]]], depth: int = 3) -> list[Site]:
    """(size, allocations, stack) records grouped by their innermost frame and the `depth` innermost
    frames outside the standard library, largest first."""
    sums: dict[tuple[str, tuple[str, ...]], list[int]] = {}
    for size, count, stack in records:
        inner = f"{_short(stack[0][1])}:{stack[0][2]}" if stack else "?"
        owners = tuple(f"{_short(f)}:{line} {fn}" for fn, f, line in stack if not _library(f))[:depth]
        entry = sums.setdefault((inner, owners), [0, 0])
        entry[0] += size
        entry[1] += count
    found = [Site(size, count, inner, owners) for (inner, owners), (size, count) in sums.items()]
    return sorted(found, key=lambda s: s.size, reverse=True)


def peak_sites(capture: Path, depth: int = 3) -> tuple[int, list[Site]]:
    """The heap's peak (bytes) in a memray capture, and the sites live then."""
    import memray

    reader = memray.FileReader(str(capture))
    records = (
        (r.size, r.n_allocations, r.stack_trace())
        for r in reader.get_high_watermark_allocation_records(merge_threads=True)
    )
    return reader.metadata.peak_memory, top_sites(records, depth)
