"""The local node's container runtime: Debian's containerd (CRI plugin, overlayfs snapshotter) run as a
process of ours, with its root, state and socket under one directory (not a system service), and
`ctr` against it. It must not build images (build_images.py does) nor touch any other containerd.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

NAMESPACE = "k8s.io"  # the CRI plugin's namespace: images the kubelet can use


@dataclass(frozen=True)
class Runtime:
    """Where our containerd keeps everything. `home` defaults to the images cache (RLHF_CONTAINERD_DIR
    moves it, e.g. into a cluster's state directory)."""

    home: Path

    @property
    def socket(self) -> Path:
        return self.home / "containerd.sock"

    @property
    def config(self) -> Path:
        return self.home / "config.toml"

    @property
    def pidfile(self) -> Path:
        return self.home / "containerd.pid"

    @property
    def log(self) -> Path:
        return self.home / "containerd.log"

    @property
    def cni_conf_dir(self) -> Path:
        return self.home / "cni" / "net.d"


def render_config(rt: Runtime, sandbox_image: str, cni_bin_dir: str = "/usr/lib/cni") -> str:
    """containerd's config (version 2): our root, state and sockets; the CRI plugin with runc and the
    overlayfs snapshotter; the pause image built here as the sandbox image. Snapshotters we never use
    (and that log errors when their file system is missing) are switched off."""
    return f"""version = 2
root = "{rt.home / "root"}"
state = "{rt.home / "state"}"
disabled_plugins = [
  "io.containerd.snapshotter.v1.aufs",
  "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.devmapper",
  "io.containerd.snapshotter.v1.zfs",
]

[grpc]
  address = "{rt.socket}"

[ttrpc]
  address = "{rt.socket}.ttrpc"

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{sandbox_image}"
  # This machine's root lacks CAP_SYS_RESOURCE, so no process may lower its oom_score_adj, and the
  # kubelet asks -998 for every pod sandbox: clamp to containerd's own value instead of failing.
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{cni_bin_dir}"
    conf_dir = "{rt.cni_conf_dir}"
"""


def ctr_command(rt: Runtime, *args: str) -> list[str]:
    return ["ctr", "--address", str(rt.socket), "--namespace", NAMESPACE, *args]


def ctr(rt: Runtime, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(ctr_command(rt, *args), capture_output=True, text=True, timeout=timeout)


def running_pid(rt: Runtime, patience: float = 0) -> int | None:
    """The pid of our containerd if it runs (pid file, process alive, and its socket answers). A live one
    that does not answer is asked again for up to `patience` seconds: importing a 7.5 GB image on a loaded
    machine, it has taken over 10 s to accept a connection."""
    try:
        pid = int(rt.pidfile.read_text().strip())
    except (OSError, ValueError):
        return None
    if not _alive(pid):
        return None
    deadline = time.monotonic() + patience
    while True:
        if rt.socket.exists() and ctr(rt, "version", timeout=10).returncode == 0:
            return pid
        if time.monotonic() >= deadline or not _alive(pid):
            return None
        time.sleep(1.0)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


def stray_pids(rt: Runtime) -> list[int]:
    """Every containerd process running on our config, whatever the pid file says (a start that lost the
    race may have overwritten it)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if (
            argv
            and Path(argv[0].decode(errors="replace")).name == "containerd"
            and str(rt.config).encode() in argv
        ):
            found.append(int(entry.name))
    return found


def _stop_pid(pid: int, timeout: float) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _alive(pid):
            return
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def start(rt: Runtime, sandbox_image: str, timeout: float = 60) -> tuple[int, bool]:
    """Starts our containerd unless it runs; returns (pid, started_now). Fails with the log's tail
    when it does not answer within `timeout` seconds. A containerd already on our root that does not
    answer within a minute is stopped first: a second one would wait forever on the metadata store's
    lock, and removing the socket of the first (as a fresh start does) would orphan it."""
    pid = running_pid(rt, patience=60)
    if pid is not None:
        return pid, False
    for stray in stray_pids(rt):
        _stop_pid(stray, timeout=30)
    for d in (rt.home / "root", rt.home / "state", rt.cni_conf_dir):
        d.mkdir(parents=True, exist_ok=True)
    rt.config.write_text(render_config(rt, sandbox_image))
    rt.socket.unlink(missing_ok=True)
    with rt.log.open("ab") as log:
        proc = subprocess.Popen(
            ["containerd", "--config", str(rt.config)],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    rt.pidfile.write_text(str(proc.pid))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        if rt.socket.exists() and ctr(rt, "version", timeout=10).returncode == 0:
            return proc.pid, True
        time.sleep(0.3)
    if proc.poll() is None:
        proc.kill()
    tail = rt.log.read_text(errors="replace").splitlines()[-20:]
    raise RuntimeError("containerd did not start; the end of {}:\n{}".format(rt.log, "\n".join(tail)))


def stop(rt: Runtime, timeout: float = 30) -> bool:
    """Stops our containerd (by its pid file); True if one was running."""
    try:
        pid = int(rt.pidfile.read_text().strip())
    except (OSError, ValueError):
        return False
    running = _alive(pid)
    if running:
        _stop_pid(pid, timeout)
    rt.pidfile.unlink(missing_ok=True)
    return running


def image_refs(rt: Runtime) -> set[str]:
    return set(image_targets(rt))


def image_targets(rt: Runtime) -> dict[str, str]:
    """Every image name in the k8s.io namespace and the digest it points to. Besides our tags there are
    the CRI plugin's own names, `sha256:<image id>`, pointing to the same digest as the tag."""
    proc = ctr(rt, "images", "ls")
    if proc.returncode != 0:
        raise RuntimeError(f"ctr images ls: {proc.stderr.strip()}")
    rows = [line.split() for line in proc.stdout.splitlines()[1:]]
    return {row[0]: row[2] for row in rows if len(row) >= 3}


def names_to_remove(targets: dict[str, str], keep: str, stale: list[str]) -> list[str]:
    """`stale` and the CRI plugin's `sha256:` names of the same images (unless `keep` points there too):
    such a name alone keeps a stale image's layers and unpacked snapshots, 7 GB for the trainer."""
    gone = {targets[r] for r in stale if r in targets} - {targets.get(keep)}
    cri_names = [r for r, digest in targets.items() if r.startswith("sha256:") and digest in gone]
    return [*stale, *sorted(cri_names)]


def import_stream(rt: Runtime, producer: list[str], timeout: float = 3600) -> None:
    """Imports the docker/OCI archive that `producer` writes to its stdout, piped into `ctr images import -`:
    no archive file between them. For the trainer image that is 7.5 GB neither written nor read back, on
    a disk that the tests beside a cold build read torch from."""
    with tempfile.TemporaryFile() as producer_err:
        with subprocess.Popen(
            producer, stdout=subprocess.PIPE, stderr=producer_err, stdin=subprocess.DEVNULL
        ) as export:
            assert export.stdout is not None
            try:
                proc = subprocess.run(
                    ctr_command(rt, "images", "import", "--snapshotter", "overlayfs", "-"),
                    stdin=export.stdout,
                    capture_output=True,
                    text=True,
                    timeout=timeout,
                )
            except BaseException:
                export.kill()
                raise
            finally:
                export.stdout.close()
            if proc.returncode != 0:
                export.kill()  # the import stopped reading: its error is the one to report
                raise RuntimeError(f"ctr images import -: {proc.stderr.strip() or proc.stdout.strip()}")
            export_rc = export.wait(timeout=300)
        producer_err.seek(0)
        err = producer_err.read().decode(errors="replace")[-2000:]
    if export_rc != 0:
        raise RuntimeError(f"{' '.join(producer[:4])} ... (exit {export_rc}): {err.strip()}")


def remove_images(rt: Runtime, refs: list[str]) -> None:
    if refs:
        ctr(rt, "images", "rm", *refs)
