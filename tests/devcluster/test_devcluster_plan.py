"""`devcluster.py build --plan`: the binaries a build would compile now (those the cache lacks) with
each one's cold estimate, which `make demo` turns into the time left."""

from __future__ import annotations

from pathlib import Path

import pytest

from devcluster import binaries, gobuild

pytestmark = pytest.mark.unit


@pytest.fixture
def cached(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> set[str]:
    """The names whose build the cache holds; no Go toolchain is run."""
    held: set[str] = set()

    def target(binary: binaries.Binary, go: str) -> Path:
        path = tmp_path / binary.name
        if binary.name in held:
            path.touch()
        return path

    monkeypatch.setattr(gobuild, "go_toolchain", lambda: "go")
    monkeypatch.setattr(gobuild, "_cache_target", target)
    return held


def test_the_plan_names_only_what_the_cache_lacks_among_the_binaries_asked_for(cached: set[str]) -> None:
    cached |= {"etcd", "kubectl"}
    todo = gobuild.plan(["etcd", "kube-apiserver", "kubectl", "helm"])
    assert todo == {
        "kube-apiserver": binaries.COLD_BUILD_S["kube-apiserver"],
        "helm": binaries.COLD_BUILD_S["helm"],
    }


def test_a_full_cache_plans_nothing_and_every_binary_has_an_estimate(cached: set[str]) -> None:
    assert set(binaries.COLD_BUILD_S) == {b.name for b in binaries.BINARIES}
    assert len(gobuild.plan()) == len(binaries.BINARIES)
    cached |= {b.name for b in binaries.BINARIES}
    assert gobuild.plan() == {}
