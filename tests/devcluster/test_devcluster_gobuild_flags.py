"""How `devcluster.py build` compiles: no DWARF from the compiler, since every link strips it anyway, its
collector at GOGC=400 under a memory limit, and the compile flags in the cache key, so a binary built
with other flags is rebuilt rather than reused."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from devcluster import binaries, gobuild

pytestmark = pytest.mark.unit


def test_every_binary_is_linked_stripped_so_the_compilers_dwarf_would_be_thrown_away() -> None:
    for b in binaries.BINARIES:
        flags = b.ldflags.split()
        assert "-s" in flags and "-w" in flags, f"{b.name} keeps its symbols: its DWARF is not wasted"


def test_a_build_compiles_without_dwarf_and_keys_the_cache_on_the_compile_flags(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    commands: list[list[str]] = []
    envs: list[dict[str, str]] = []

    def fake_go_build(
        cmd: list[str], cwd: Path, env: dict[str, str], name: str, verbose: bool, every: float = 30.0
    ) -> subprocess.CompletedProcess[str]:
        commands.append(cmd)
        envs.append(env)
        Path(cmd[cmd.index("-o") + 1]).write_text("binary")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(gobuild, "go_toolchain", lambda: "true")  # `true version`: an empty version line
    monkeypatch.setattr(gobuild, "CACHE", tmp_path / "cache")
    monkeypatch.setattr(gobuild, "STATE", tmp_path / "state")
    monkeypatch.setattr(gobuild, "_run_with_heartbeat", fake_go_build)
    monkeypatch.delenv("GOGC", raising=False)
    monkeypatch.setenv("GOMEMLIMIT", "1GiB")  # the user's own setting wins
    gobuild.build(verbose=False, names=["etcd"])
    (cmd,) = commands
    assert cmd[cmd.index("-gcflags") + 1] == "all=-dwarf=false"
    assert (envs[0]["GOGC"], envs[0]["GOMEMLIMIT"]) == ("400", "1GiB")

    etcd = next(b for b in binaries.BINARIES if b.name == "etcd")
    key = gobuild._build_key(etcd, "true")
    monkeypatch.setattr(gobuild, "GCFLAGS", "all=-N -l")
    assert gobuild._build_key(etcd, "true") != key, "other compile flags must not reuse the cached build"
