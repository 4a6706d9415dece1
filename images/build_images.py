#!/usr/bin/env python3
"""`make images`: builds the operator image, the CPU trainer image and the pause image here, with no
registry, and loads them into the local node's containerd; `make images-gpu` (step `trainer-gpu`)
builds the GPU trainer image and checks it with containerd and runc. Owns the order of the steps, the
caches (content hashes) and the prerequisite checks; what goes into an image is recipe.py's and the
Dockerfiles', and the runtime process is containerd_runtime.py's.

    python3 images/build_images.py [all|base|operator|trainer|trainer-gpu|pause|refs|runtime-up|...]

Standard library only (it runs before the project's virtualenv matters). Ends `all` with exactly two
lines: `operator-image: REF` and `trainer-image: REF`; `trainer-gpu` with `trainer-gpu-image: REF`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import containerd_runtime as runtime
import image_recipe as recipe
from image_recipe import ROOT, ImageSpec, Wheelhouse

CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "rlhf-operator" / "images"
PAUSE_SOURCE = Path(__file__).resolve().parent / "pause" / "pause.c"
HEARTBEAT_S = 30.0  # a long step prints a progress line at least this often
MAKE_IMAGES = ("operator", "trainer")  # `all`; the GPU trainer image is `make images-gpu`'s alone

# Command -> Debian package that provides it (installed with apt-get when missing and we are root).
TOOLS = {
    "mmdebstrap": "mmdebstrap",
    "buildah": "buildah",
    "containerd": "containerd",
    "ctr": "containerd",
    "runc": "runc",
    "gcc": "gcc",
}
STEPS = (
    "all",
    "base",
    "operator",
    "trainer",
    "trainer-gpu",
    "pause",
    "refs",
    "plan",
    "runtime-up",
    "runtime-down",
    "runtime-status",
)


# What each part of `make images` costs when nothing is cached, on this 2-core machine: as `make demo`
# built them on a fresh machine beside the Go builds (2026-12-07; the trainer's load then went through an
# archive file, 283 s; streamed, 211 s alone). The estimates `plan` adds up for the parts a run would do.
COLD_S = {
    "base": 59,  # mmdebstrap 47 s, import 12 s
    "operator wheelhouse": 6,
    "operator build": 49,
    "operator load": 21,
    "trainer wheelhouse": 89,  # 214 wheels, 3.2 GiB from PyPI
    "trainer build": 353,
    "trainer load": 283,
    # Our code changed and nothing else: the dependency layers are reused (`Using cache`), the code layer
    # is built, and the load re-exports the image while containerd skips the layers it has.
    "operator code": 30,
    "operator reload": 30,
    "trainer code": 60,
    "trainer reload": 150,
}


class Missing(RuntimeError):
    """A prerequisite of building or running containers is missing; the message names it."""


def log(msg: str) -> None:
    print(f"[images] {msg}", flush=True)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="images/build_images.py", description=__doc__.split("\n\n")[0])
    p.add_argument("step", nargs="?", default="all", choices=STEPS)
    p.add_argument(
        "--no-load",
        action="store_true",
        help="build only; do not load the images into containerd (trainer-gpu: nor check it)",
    )
    p.add_argument(
        "--keep-runtime",
        action="store_true",
        help="leave containerd running after loading (it is stopped if this run started it)",
    )
    return p.parse_args(list(argv))


def runtime_home() -> Path:
    return Path(os.environ.get("RLHF_CONTAINERD_DIR", CACHE / "containerd"))


# ---- prerequisites ----------------------------------------------------------------------------------


def missing_tools(which: object = shutil.which) -> list[str]:
    return [tool for tool in TOOLS if not which(tool)]  # type: ignore[operator]


def kernel_problems(
    filesystems: Path = Path("/proc/filesystems"), cgroup_root: Path = Path("/sys/fs/cgroup")
) -> list[str]:
    """What the kernel lacks for buildah and containerd's overlayfs snapshotter and runc."""
    problems = []
    try:
        names = {line.split()[-1] for line in filesystems.read_text().splitlines() if line.strip()}
    except OSError:
        names = set()
    if "overlay" not in names:
        problems.append("the kernel's overlay file system (modprobe overlay)")
    if not cgroup_root.is_dir() or not any(cgroup_root.iterdir()):
        problems.append(f"a mounted cgroup hierarchy at {cgroup_root}")
    return problems


def apt_install(packages: Sequence[str]) -> None:
    """Debian's packages by name (root only; waits for another apt-get's lock); Missing on failure."""
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    lock = ["-o", "DPkg::Lock::Timeout=600"]
    for cmd in (
        ["apt-get", *lock, "update", "-qq"],
        ["apt-get", *lock, "install", "-y", "-qq", "--no-install-recommends", *packages],
    ):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
        if proc.returncode != 0:
            raise Missing(f"{' '.join(packages)}: `{' '.join(cmd)}` failed:\n{proc.stderr[-2000:]}")


def ensure_prerequisites() -> None:
    if os.geteuid() != 0:
        raise Missing("building and running containers here needs root (buildah and containerd run rootful)")
    missing = missing_tools(shutil.which)
    if missing:
        packages = sorted({TOOLS[t] for t in missing})
        log(f"installing Debian packages {' '.join(packages)} (missing: {' '.join(missing)})")
        apt_install(packages)
        still = missing_tools(shutil.which)
        if still:
            raise Missing(f"still missing after apt-get: {' '.join(still)}")
    problems = kernel_problems()
    if problems:
        raise Missing("this machine cannot run containers: missing " + "; ".join(problems))


# ---- buildah ----------------------------------------------------------------------------------------


def buildah(*args: str) -> list[str]:
    return [
        "buildah",
        "--root",
        str(CACHE / "buildah" / "storage"),
        "--runroot",
        str(CACHE / "buildah" / "run"),
        "--storage-driver",
        "overlay",
        *args,
    ]


@contextlib.contextmanager
def heartbeat(what: str, every: float = HEARTBEAT_S) -> Iterator[None]:
    """Logs `what: still running (Ns)` every `every` seconds until the block ends: a pip install, an
    export or an import can be silent for minutes."""
    done = threading.Event()
    t0 = time.monotonic()

    def beat() -> None:
        while not done.wait(every):
            log(f"{what}: still running ({time.monotonic() - t0:.0f}s)")

    thread = threading.Thread(target=beat, name="heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def run(cmd: list[str], timeout: float, what: str, cwd: Path | None = None, quiet: bool = False) -> str:
    """Runs a build step; its output goes to our stdout (progress) unless quiet, and a heartbeat line
    every 30 s either way. Fails naming the step."""
    with heartbeat(what):
        proc = subprocess.run(
            cmd,
            cwd=cwd,
            timeout=timeout,
            text=True,
            stdout=subprocess.PIPE if quiet else None,
            stderr=subprocess.STDOUT if quiet else None,
            stdin=subprocess.DEVNULL,
        )
    if proc.returncode != 0:
        tail = (proc.stdout or "")[-3000:]
        raise RuntimeError(f"{what} failed (exit {proc.returncode}): {' '.join(cmd[:6])} ...\n{tail}")
    return proc.stdout or ""


def buildah_images(repository: str) -> set[str]:
    """Tags (localhost/name:tag) of `repository` in our buildah storage; none where buildah is not
    installed yet (a fresh machine, before `make images` installs it: `plan` runs first)."""
    if shutil.which("buildah") is None:
        return set()
    proc = subprocess.run(
        buildah("images", "--format", "{{.Name}}:{{.Tag}}", "--filter", f"reference={repository}"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    if proc.returncode != 0:
        return set()
    return {line.strip() for line in proc.stdout.splitlines() if line.strip()}


def drop_other_tags(keep: str) -> None:
    """One copy of each image in the store: older content hashes of the same family go (the `cpu-` and
    `gpu-` trainer tags are two families of one repository)."""
    family = recipe.family(keep)
    old = sorted(
        t for t in buildah_images(keep.rsplit(":", 1)[0]) if recipe.family(t) == family and t != keep
    )
    if old:
        subprocess.run(buildah("rmi", *old), capture_output=True, timeout=600)


def image_size(ref: str) -> str:
    proc = subprocess.run(
        buildah("images", "--format", "{{.Size}}", ref), capture_output=True, text=True, timeout=60
    )
    return proc.stdout.strip().splitlines()[0] if proc.returncode == 0 and proc.stdout.strip() else "?"


# ---- the steps --------------------------------------------------------------------------------------


def build_base() -> str:
    """The Debian bookworm root file system (mmdebstrap), imported as a local base image."""
    h = recipe.base_hash()
    ref = recipe.base_ref(h)
    if ref in buildah_images(ref.rsplit(":", 1)[0]):
        log(f"base {ref}: up to date")
        return ref
    tarball = CACHE / "base" / f"rootfs-{h[:16]}.tar"
    if not tarball.exists():
        tarball.parent.mkdir(parents=True, exist_ok=True)
        for old in tarball.parent.glob("rootfs-*.tar*"):
            old.unlink()
        partial = tarball.with_suffix(".tar.partial")
        log("base: mmdebstrap --variant=minbase bookworm (Debian's archive; about 3 minutes)")
        t0 = time.monotonic()
        run(recipe.mmdebstrap_args(partial), 1800, "mmdebstrap", quiet=True)
        partial.rename(tarball)
        log(f"base: root file system in {time.monotonic() - t0:.0f}s ({tarball.stat().st_size >> 20} MiB)")
    t0 = time.monotonic()
    container = run(buildah("from", "--quiet", "scratch"), 120, "buildah from scratch", quiet=True).strip()
    try:
        run(buildah("add", "--quiet", container, str(tarball), "/"), 600, "buildah add (base)", quiet=True)
        run(
            buildah(
                "config",
                "--env",
                "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                "--env",
                "LANG=C.UTF-8",
                "--cmd",
                "/bin/bash",
                "--label",
                f"rlhf.dev/base-recipe={h}",
                container,
            ),
            60,
            "buildah config (base)",
            quiet=True,
        )
        run(buildah("commit", "--quiet", "--rm", container, ref), 600, "buildah commit (base)", quiet=True)
    except BaseException:
        subprocess.run(buildah("rm", container), capture_output=True, timeout=120)
        raise
    drop_other_tags(ref)
    log(f"base {ref}: imported in {time.monotonic() - t0:.0f}s")
    return ref


def host_python() -> str:
    """A Python 3.11 to run pip on the host: wheels must match the image's Debian python3 (3.11)."""
    for candidate in (str(ROOT / ".venv" / "bin" / "python"), "python3.11", "python3"):
        exe = shutil.which(candidate) or (candidate if Path(candidate).exists() else None)
        if not exe:
            continue
        proc = subprocess.run(
            [exe, "-c", "import sys; print(sys.version_info[:2] == (3, 11))"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        if proc.stdout.strip() == "True":
            return exe
    raise Missing("Python 3.11 on the host (the wheelhouse must match Debian bookworm's python3)")


def build_wheelhouse(wh: Wheelhouse) -> Path:
    """The image's wheels, through the host's pip and its cache (~/.cache/pip): one `pip wheel` that
    resolves everything together (sdists are built into wheels, or taken from pip's wheel cache), and
    `pip download --no-deps` for the rest. Counts what pip fetched from the network."""
    key = wh.key()[:16]
    target = CACHE / "wheelhouse" / f"{wh.name}-{key}"
    if (target / "pip.conf").exists():
        log(f"wheelhouse {wh.name}: up to date ({len(list(target.glob('*.whl')))} wheels)")
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    for old in target.parent.glob(f"{wh.name}-*"):
        shutil.rmtree(old)
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    python = host_python()
    log(f"wheelhouse {wh.name}: pip wheel {len(wh.resolved)} requirements (pip cache first)")
    t0 = time.monotonic()
    base = [python, "-m", "pip", "--disable-pip-version-check"]
    out = run(
        [*base, "wheel", "--wheel-dir", str(partial), *wh.resolved], 3600, "pip wheel", cwd=ROOT, quiet=True
    )
    for kind, what, names in (
        ("--only-binary=:all:", "pip download", wh.no_deps),
        ("--no-binary=:all:", "pip download (source distributions)", wh.sdists),
    ):
        if names:
            cmd = [*base, "download", "--no-deps", kind, "--dest", str(partial), *names]
            out += run(cmd, 1800, what, cwd=ROOT, quiet=True)
    downloaded = [line.split()[1] for line in out.splitlines() if line.strip().startswith("Downloading ")]
    cached = [line for line in out.splitlines() if "Using cached" in line or "already downloaded" in line]
    (partial / "pip.conf").write_text("[global]\nno-index = true\nfind-links = /wheels\n")
    (partial / "fetched.txt").write_text("\n".join(downloaded) + "\n")
    partial.rename(target)
    size = sum(p.stat().st_size for p in target.glob("*.whl")) >> 20
    log(
        f"wheelhouse {wh.name}: {len(list(target.glob('*.whl')))} wheels, {size} MiB in "
        f"{time.monotonic() - t0:.0f}s; {len(downloaded)} downloaded, {len(cached)} from pip's cache"
    )
    return target


def build_image(spec: ImageSpec, base: str, rt: runtime.Runtime | None) -> str:
    """Builds `spec` with buildah unless an image with its content hash exists (in buildah's storage or
    already loaded in containerd)."""
    ref = recipe.image_ref(spec, recipe.image_hash(spec, base))
    repository = ref.rsplit(":", 1)[0]
    loaded = rt is not None and runtime.running_pid(rt) is not None and ref in runtime.image_refs(rt)
    if ref in buildah_images(repository) or loaded:
        log(f"{spec.name} {ref}: up to date")
        return ref
    wheels = build_wheelhouse(spec.wheelhouse)
    args = [f"--build-arg={k}={v}" for k, v in sorted(recipe.build_args(spec, base).items())]
    cmd = buildah(
        "bud",
        # Layers are cached: a change to our code rebuilds the small layers after the dependencies'.
        "--layers=true",
        "--pull-never",
        f"--network={spec.network}",
        f"--volume={wheels}:/wheels:ro",
        "--file",
        str(ROOT / spec.dockerfile),
        *(["--target", spec.target] if spec.target else []),
        *args,
        "--tag",
        ref,
        str(ROOT),
    )
    log(
        f"{spec.name}: buildah bud {spec.dockerfile}{' --target ' + spec.target if spec.target else ''} -> {ref}"
    )
    t0 = time.monotonic()
    run(cmd, 5400, f"building {spec.name}")
    drop_other_tags(ref)
    log(f"{spec.name} {ref}: built in {time.monotonic() - t0:.0f}s, {image_size(ref)}")
    return ref


def build_pause() -> str:
    """The pod sandbox image: pause.c compiled statically, alone in an image."""
    source = PAUSE_SOURCE.read_bytes()
    ref = recipe.pause_ref(source)
    if ref in buildah_images(ref.rsplit(":", 1)[0]):
        log(f"pause {ref}: up to date")
        return ref
    with tempfile.TemporaryDirectory(prefix="rlhf-pause-") as tmp:
        binary = Path(tmp) / "pause"
        run(
            ["gcc", "-static", "-Os", "-s", "-o", str(binary), str(PAUSE_SOURCE)],
            300,
            "gcc pause.c",
            quiet=True,
        )
        container = run(
            buildah("from", "--quiet", "scratch"), 120, "buildah from scratch", quiet=True
        ).strip()
        try:
            run(buildah("copy", "--quiet", container, str(binary), "/pause"), 120, "buildah copy", quiet=True)
            run(
                buildah("config", "--entrypoint", '["/pause"]', "--user", "65535:65535", container),
                60,
                "buildah config (pause)",
                quiet=True,
            )
            run(
                buildah("commit", "--quiet", "--rm", container, ref),
                300,
                "buildah commit (pause)",
                quiet=True,
            )
        except BaseException:
            subprocess.run(buildah("rm", container), capture_output=True, timeout=120)
            raise
    drop_other_tags(ref)
    log(f"pause {ref}: built")
    return ref


def load(rt: runtime.Runtime, refs: Sequence[str]) -> None:
    """Copies each image from buildah's storage into containerd's k8s.io namespace (unless there), its
    docker archive streamed from `buildah push` into `ctr images import`; older tags of the same family
    are removed there."""
    present = runtime.image_refs(rt)
    for ref in refs:
        stale = [r for r in present if recipe.family(r) == recipe.family(ref) and r != ref]
        if ref in present:
            log(f"containerd: {ref} already loaded")
        else:
            t0 = time.monotonic()
            # buildah's export streamed into containerd's import: no archive file between them.
            with heartbeat(f"load {ref}"):
                runtime.import_stream(
                    rt, buildah("push", "--quiet", ref, f"docker-archive:/dev/stdout:{ref}")
                )
            log(
                f"containerd: {ref} loaded in {time.monotonic() - t0:.0f}s (export streamed into import and unpack)"
            )
        runtime.remove_images(rt, runtime.names_to_remove(runtime.image_targets(rt), ref, stale))


# ---- the GPU trainer image (`make images-gpu`) ------------------------------------------------------

# Run in the GPU image with no GPU (`ctr run`: loopback only, uid 10001): the stack imports and reports
# its versions; torch's CUDA is 13.0 and sees no device; FusedAdam was prebuilt and loads; the RDMA user
# space NCCL loads is there (libibverbs, its providers, librdmacm) and `ibv_devices` runs.
GPU_IMAGE_CHECK = r"""
set -euo pipefail
exec 2>&1
echo "user: $(id -u):$(id -g), home $HOME, network interfaces: $(ls /sys/class/net | xargs)"
command -v ibv_devices >/dev/null
echo "ibv_devices:"; rc=0; ibv_devices || rc=$?; echo "ibv_devices exit status: $rc"
echo "libibverbs providers: $(ls /usr/lib/x86_64-linux-gnu/libibverbs/ | sed 's/-rdmav[0-9]*[.]so//' | xargs)"
echo "nvcc (CUDA_HOME=$CUDA_HOME): $("$CUDA_HOME/bin/nvcc" --version | grep release)"
python - <<'CHECK'
import ctypes, glob, importlib, os, subprocess, sys, time
t0 = time.monotonic()
import torch, vllm, deepspeed, ray, rlhf_trainer
from deepspeed.git_version_info import installed_ops
from vllm.platforms import current_platform
print(f"imports of torch, vllm, deepspeed, ray, rlhf_trainer: {time.monotonic() - t0:.1f}s"
      f" (python {sys.version.split()[0]})")
print("torch", torch.__version__, "| torch.version.cuda", torch.version.cuda,
      "| cuDNN", torch.backends.cudnn.version(), "| NCCL", ".".join(map(str, torch.cuda.nccl.version())))
print("torch.cuda.is_available():", torch.cuda.is_available())
print("vllm", vllm.__version__, "| platform:", type(current_platform).__name__)
importlib.import_module("deepspeed.ops.adam.fused_adam_op")
prebuilt = sorted(name for name, on in installed_ops.items() if on)
print("deepspeed", deepspeed.__version__, "| prebuilt ops:", prebuilt, "(fused_adam_op loads)")
print("ray", ray.__version__)
for lib in ("libibverbs.so.1", "librdmacm.so.1", "libmlx5.so.1"):
    ctypes.CDLL(lib)
print("dlopen of libibverbs.so.1, librdmacm.so.1, libmlx5.so.1: ok")
# What the CUDA, NCCL and torch libraries link that the image lacks, with their own directories on the
# search path as torch's loader has them; the driver's libcuda and NVML come from the host.
site = os.path.dirname(os.path.dirname(torch.__file__))
libs = glob.glob(f"{site}/nvidia/**/*.so*", recursive=True) + glob.glob(f"{site}/torch/lib/*.so*")
env = dict(os.environ, LD_LIBRARY_PATH=":".join(sorted({os.path.dirname(lib) for lib in libs})))
missing = {}
for lib in libs:
    out = subprocess.run(["ldd", lib], capture_output=True, text=True, env=env).stdout
    for dep in {line.split()[0] for line in out.splitlines() if "not found" in line}:
        if dep not in ("libcuda.so.1", "libnvidia-ml.so.1"):
            missing.setdefault(dep, []).append(os.path.relpath(lib, site))
print(f"ldd of {len(libs)} CUDA, NCCL and torch libraries; missing besides the driver's:",
      "; ".join(f"{dep} (for {', '.join(sorted(users))})" for dep, users in sorted(missing.items())) or "none")
assert torch.version.cuda.startswith("13.0"), torch.version.cuda
assert not torch.cuda.is_available()
assert installed_ops.get("fused_adam"), installed_ops
CHECK
"""


def check_record(ref: str) -> Path:
    """Where the in-image check's output is kept: an image with this content hash passed it."""
    return CACHE / "checks" / f"{ref.rsplit('/', 1)[-1].replace(':', '-')}.txt"


def image_config(ref: str) -> dict[str, object]:
    """The OCI config of an image in buildah's storage (Env, User, WorkingDir, ...)."""
    out = run(buildah("inspect", "--type", "image", ref), 120, "buildah inspect", quiet=True)
    config: dict[str, object] = json.loads(out)["OCIv1"]["config"]
    return config


def passwd_home(passwd: Path, uid: str) -> str:
    """The home directory of `uid` (a number or a name) in an /etc/passwd file; / if it has none."""
    for line in passwd.read_text().splitlines():
        fields = line.split(":")
        if len(fields) >= 6 and uid in (fields[0], fields[2]):
            return fields[5]
    return "/"


def check_gpu_image(pause: str, ref: str) -> str:
    """Runs GPU_IMAGE_CHECK in `ref` with containerd and runc, with no GPU, as the image's user, with its
    environment and working directory; returns the output, fails on error. The root file system is the
    image's layers in buildah's storage, mounted (`buildah mount`), so nothing is copied: loading the
    10 GB image into a containerd would need about 15 GB more disk (its compressed content and the
    unpacked snapshot) and 4 to 5 minutes. The containerd is one of our own, started for the check and
    removed after, so the real node's containerd (which tests restart) is never touched."""
    rt = runtime.Runtime(CACHE / "gpu-check")
    shutil.rmtree(rt.home, ignore_errors=True)  # what an interrupted check left
    config = image_config(ref)
    uid, _, gid = str(config.get("User") or "0").partition(":")
    env_list = config.get("Env")
    env = [f"--env={e}" for e in env_list] if isinstance(env_list, list) else []
    cwd = str(config.get("WorkingDir") or "/")
    container = run(buildah("from", "--quiet", "--pull-never", ref), 300, "buildah from", quiet=True).strip()
    t0 = time.monotonic()
    try:
        rootfs = run(buildah("mount", container), 120, "buildah mount", quiet=True).strip()
        home = passwd_home(Path(rootfs) / "etc" / "passwd", uid)
        pid, _ = runtime.start(rt, pause)
        log(f"in-image check: containerd of its own (pid {pid}), the image's root file system {rootfs}")
        try:
            # ctr runs a --rootfs container as root: setpriv drops to the image's user (util-linux's).
            user = ["setpriv", f"--reuid={uid}", f"--regid={gid or uid}", "--clear-groups"]
            name = f"rlhf-gpu-check-{uuid.uuid4().hex[:8]}"
            args = [
                "run",
                "--rm",
                "--rootfs",
                *env,
                f"--env=HOME={home}",
                f"--cwd={cwd}",
                rootfs,
                name,
                *user,
            ]
            with heartbeat(f"in-image check of {ref}"):
                proc = runtime.ctr(rt, *args, "bash", "-c", GPU_IMAGE_CHECK, timeout=900)
        finally:
            runtime.stop(rt)
            shutil.rmtree(rt.home, ignore_errors=True)
    finally:
        subprocess.run(buildah("umount", container), capture_output=True, timeout=120)
        subprocess.run(buildah("rm", container), capture_output=True, timeout=120)
    output = (proc.stdout + proc.stderr).strip()
    if proc.returncode != 0:
        raise RuntimeError(f"the in-image check of {ref} failed (exit {proc.returncode}):\n{output[-4000:]}")
    log(f"in-image check of {ref}: passed in {time.monotonic() - t0:.0f}s")
    return output


def build_trainer_gpu(pause: str, base: str, check: bool) -> str:
    """`make images-gpu`: builds the GPU trainer image and runs the in-image check with no GPU. The
    image stays in buildah's storage, from which it is pushed; it is not loaded into the real node's
    containerd (nothing here can run it). A content hash that passed the check before skips it and
    shows the output kept then."""
    spec = recipe.image_specs()["trainer-gpu"]
    ref = build_image(spec, base, None)
    log(f"{spec.name} {ref}: {image_size(ref)} unpacked")
    if not check:
        log("--no-load: built only, not checked")
        return ref
    record = check_record(ref)
    if record.exists():
        log(f"in-image check: passed before for this content hash; its output ({record}):")
        print(record.read_text().rstrip(), flush=True)
        return ref
    output = check_gpu_image(pause, ref)
    print(output, flush=True)
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text(output + "\n")
    return ref


def plan(rt: runtime.Runtime) -> dict[str, int]:
    """The parts `all` would do now and the cold estimate of each (COLD_S), without building anything:
    what a caller shows as the time left. An image whose wheelhouse is cached and of which an older
    build exists is taken to change only in our code (its dependency layers reused)."""
    todo: dict[str, int] = {}
    base = recipe.base_ref()
    if base not in buildah_images(base.rsplit(":", 1)[0]):
        todo["base"] = COLD_S["base"]
    loaded = runtime.image_refs(rt) if runtime.running_pid(rt) is not None else set()
    for name in MAKE_IMAGES:
        spec = recipe.image_specs()[name]
        ref = recipe.image_ref(spec, recipe.image_hash(spec, base))
        if ref in loaded:
            continue
        built = buildah_images(ref.rsplit(":", 1)[0])
        wheels = (CACHE / "wheelhouse" / f"{spec.wheelhouse.name}-{spec.wheelhouse.key()[:16]}").exists()
        older = (
            wheels
            and "base" not in todo
            and any(recipe.family(r) == recipe.family(ref) for r in built - {ref})
        )
        if ref not in built:
            if not wheels:
                todo[f"{name} wheelhouse"] = COLD_S[f"{name} wheelhouse"]
            todo[f"{name} {'code' if older else 'build'}"] = COLD_S[f"{name} {'code' if older else 'build'}"]
        todo[f"{name} {'reload' if older else 'load'}"] = COLD_S[f"{name} {'reload' if older else 'load'}"]
    return todo


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    rt = runtime.Runtime(runtime_home())
    try:
        if args.step == "runtime-down":
            log("containerd stopped" if runtime.stop(rt) else "containerd was not running")
            return 0
        if args.step == "runtime-status":
            pid = runtime.running_pid(rt)
            print(f"containerd: {'running, pid ' + str(pid) if pid else 'stopped'} (socket {rt.socket})")
            return 0 if pid else 1
        if args.step == "refs":
            base = recipe.base_ref()
            for name, spec in recipe.image_specs().items():
                print(f"{name}-image: {recipe.image_ref(spec, recipe.image_hash(spec, base))}")
            print(f"pause-image: {recipe.pause_ref(PAUSE_SOURCE.read_bytes())}")
            return 0
        if args.step == "plan":
            todo = plan(rt)
            parts = (
                ", ".join(f"{part} ~{seconds}s" for part, seconds in todo.items()) or "nothing: all cached"
            )
            print(f"[images] plan: {parts}")
            print(f"images-plan-seconds: {sum(todo.values())}")
            return 0
        ensure_prerequisites()
        CACHE.mkdir(parents=True, exist_ok=True)
        t_all = time.monotonic()
        pause = build_pause()
        if args.step == "runtime-up":
            pid, _ = runtime.start(rt, pause)
            load(rt, [pause])
            log(f"containerd running, pid {pid}, socket {rt.socket}")
            return 0
        if args.step == "pause":
            print(f"pause-image: {pause}")
            return 0
        base = build_base()
        if args.step == "base":
            print(f"base-image: {base}")
            return 0
        if args.step == "trainer-gpu":
            ref = build_trainer_gpu(pause, base, check=not args.no_load)
            log(f"done in {time.monotonic() - t_all:.0f}s")
            print(f"trainer-gpu-image: {ref}")
            return 0
        specs = recipe.image_specs()
        names = list(MAKE_IMAGES) if args.step == "all" else [args.step]
        if args.no_load:
            refs = {name: build_image(specs[name], base, None) for name in names}
        else:
            pid, started = runtime.start(rt, pause)
            log(f"containerd {'started' if started else 'running'} (pid {pid}, socket {rt.socket})")
            try:
                refs = {name: build_image(specs[name], base, rt) for name in names}
                load(rt, [pause, *refs.values()])
            finally:
                if started and not args.keep_runtime:
                    runtime.stop(rt)
        log(f"done in {time.monotonic() - t_all:.0f}s")
        print(f"pause-image: {pause}")
        for name, ref in refs.items():
            print(f"{name}-image: {ref}")
        return 0
    except Missing as e:
        print(f"error: missing: {e}", file=sys.stderr)
        return 2
    except (RuntimeError, subprocess.TimeoutExpired, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
