"""Builds the binaries with `go build` from the Go module proxy, cached under the user's cache
directory by a key of the Go version, the wrapper module's files and the link flags, and links them
into the state directory's bin/. It never downloads a release binary.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import time
from collections.abc import Iterable
from pathlib import Path

from devcluster.binaries import BINARIES, COLD_BUILD_S, Binary
from devcluster.config import CACHE, GO_DIR, STATE, ClusterError


def go_toolchain() -> str:
    go = shutil.which("go") or ("/usr/local/go/bin/go" if Path("/usr/local/go/bin/go").exists() else None)
    if not go:
        raise ClusterError(
            "Go toolchain not found: the local control plane is built from the Go module proxy.\n"
            "Install Go >= 1.26 (https://go.dev/doc/install, or Debian's golang-go if recent enough) "
            "and make sure `go` is on PATH."
        )
    return go


# Every binary is linked stripped (`-s -w` in its link flags), so the DWARF the compiler would write for
# each package is thrown away at the link: not generating it is CPU a cold build saves (docs/development.md).
GCFLAGS = "all=-dwarf=false"
# The compiler and linker are Go programs: with GOGC=400 they collect a quarter as often, and GOMEMLIMIT
# bounds what that costs in memory (a cold build runs beside the trainer tests). Together with GCFLAGS,
# a cold build of etcd took 77-79 CPU-s instead of 102 (docs/development.md). Neither changes the binary.
GO_GC_ENV = {"GOGC": "400", "GOMEMLIMIT": "3GiB"}


def _build_key(binary: Binary, go: str) -> str:
    """Cache key: Go version, wrapper module content, compile and link flags, so a pin change rebuilds."""
    h = hashlib.sha256()
    h.update(subprocess.run([go, "version"], capture_output=True, text=True, check=True).stdout.encode())
    h.update(GCFLAGS.encode())
    mod_dir = GO_DIR / binary.module_dir
    for name in sorted(p.name for p in mod_dir.iterdir() if p.is_file()):
        h.update(name.encode())
        h.update((mod_dir / name).read_bytes())
    h.update(binary.package.encode())
    h.update(binary.ldflags.encode())
    h.update(binary.tags.encode())
    return h.hexdigest()[:16]


def _run_with_heartbeat(
    cmd: list[str], cwd: Path, env: dict[str, str], name: str, verbose: bool, every: float = 30.0
) -> subprocess.CompletedProcess[str]:
    """Runs a build, saying every `every` seconds that it still runs: a cold Kubernetes build is
    minutes of silence otherwise."""
    started = time.monotonic()
    with subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as proc:
        while True:
            try:
                out, err = proc.communicate(timeout=every)
                break
            except subprocess.TimeoutExpired:
                if verbose:
                    print(f"[build] {name}: still compiling ({time.monotonic() - started:.0f}s)", flush=True)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def binary_path(name: str) -> Path:
    return STATE / "bin" / name


def build(verbose: bool = True, names: Iterable[str] | None = None) -> dict[str, Path]:
    """Build (or reuse from the cache) every binary, or those named, and link each into .cluster/bin."""
    wanted = set(names) if names is not None else None
    go = go_toolchain()
    (STATE / "bin").mkdir(parents=True, exist_ok=True)
    out: dict[str, Path] = {}
    env = dict(os.environ)
    # go.sum is committed for every wrapper module: verify against it, never fetch a checksum database.
    env.setdefault("GOFLAGS", "-mod=readonly")
    env["GOFLAGS"] = env["GOFLAGS"] + " -buildvcs=false"
    env.setdefault("GOSUMDB", "off")
    env.setdefault("CGO_ENABLED", "0")
    for name, value in GO_GC_ENV.items():
        env.setdefault(name, value)
    for binary in BINARIES:
        if wanted is not None and binary.name not in wanted:
            continue
        target = _cache_target(binary, go)
        if not target.exists():
            if verbose:
                print(f"[build] {binary.name} ({binary.package}) ...", flush=True)
            started = time.monotonic()
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_suffix(".tmp")
            tags = ["-tags", binary.tags] if binary.tags else []
            cmd = [
                go,
                "build",
                *tags,
                "-gcflags",
                GCFLAGS,
                "-ldflags",
                binary.ldflags,
                "-o",
                str(tmp),
                binary.package,
            ]
            proc = _run_with_heartbeat(cmd, GO_DIR / binary.module_dir, env, binary.name, verbose)
            if proc.returncode != 0:
                raise ClusterError(
                    f"building {binary.name} failed (go build in {GO_DIR / binary.module_dir}):\n"
                    + "\n".join(proc.stderr.splitlines()[-30:])
                    + "\nCheck network access to the Go module proxy (GOPROXY) and the Go version (>= 1.26)."
                )
            tmp.rename(target)
            if verbose:
                print(f"[build] {binary.name} done in {time.monotonic() - started:.0f}s", flush=True)
        out[binary.name] = _link(binary.name, target)
    return out


def plan(names: Iterable[str] | None = None) -> dict[str, int]:
    """The binaries `build(names)` would compile now (not in the cache) and the cold estimate of each."""
    wanted = set(names) if names is not None else None
    go = go_toolchain()
    return {
        b.name: COLD_BUILD_S[b.name]
        for b in BINARIES
        if (wanted is None or b.name in wanted) and not _cache_target(b, go).exists()
    }


def _cache_target(binary: Binary, go: str) -> Path:
    return CACHE / "bin" / f"{binary.name}-{_build_key(binary, go)}" / binary.name


def _link(name: str, target: Path) -> Path:
    link = binary_path(name)
    link.parent.mkdir(parents=True, exist_ok=True)
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(target)
    return link


def built_binary(name: str) -> Path | None:
    """The binary's link in .cluster/bin if the cache holds a build of the current pin, without building."""
    binary = next(b for b in BINARIES if b.name == name)
    target = _cache_target(binary, go_toolchain())
    return _link(name, target) if target.exists() else None
