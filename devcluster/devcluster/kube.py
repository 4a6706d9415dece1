"""kubectl against the running cluster, the Go module cache's copies of the pinned modules (CRDs and
manifests are read from there, never copied into the repo), and KubeRay's CRDs.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

from devcluster.config import GO_DIR, STATE, ClusterError
from devcluster.gobuild import binary_path, go_toolchain
from devcluster.processes import log_tail


def kubectl(*args: str, input: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    cmd = [str(binary_path("kubectl")), f"--kubeconfig={STATE / 'kubeconfig'}", *args]
    proc = subprocess.run(cmd, input=input, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise ClusterError(f"kubectl {' '.join(args)} failed:\n{proc.stderr}")
    return proc


def module_dir(wrapper: str, module: str) -> Path:
    """Where the Go module cache holds `module` at the version the wrapper module `wrapper` pins
    (downloaded first if missing): the CRDs and manifests are read from there, never copied here."""
    cmd = [go_toolchain(), "list", "-m", "-json", module]
    env = {**os.environ, "GOFLAGS": "-mod=readonly"}
    proc = subprocess.run(cmd, cwd=GO_DIR / wrapper, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise ClusterError(f"cannot locate the module {module}: {proc.stderr}")
    mod_dir = json.loads(proc.stdout).get("Dir")
    if not mod_dir:
        subprocess.run([go_toolchain(), "mod", "download", module], cwd=GO_DIR / wrapper, check=True, env=env)
        return module_dir(wrapper, module)
    return Path(mod_dir)


def kuberay_crd_dir() -> Path:
    """KubeRay's CRDs, read from the Go module cache at the pinned version (never copied into the repo)."""
    return module_dir("kuberay", "github.com/ray-project/kuberay/ray-operator") / "config" / "crd" / "bases"


def wait_default_objects() -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if kubectl("get", "namespace", "default", check=False).returncode == 0:
            return
        time.sleep(0.5)
    raise ClusterError(
        "the API server did not create the default namespace in 60s:\n" + log_tail("kube-apiserver")
    )


def install_kuberay_crds() -> None:
    crd_dir = kuberay_crd_dir()
    files = sorted(crd_dir.glob("*.yaml"))
    if not files:
        raise ClusterError(f"no KubeRay CRDs found in {crd_dir}")
    for f in files:
        kubectl("apply", "--server-side", "--force-conflicts", "-f", str(f))
    kubectl(
        "wait",
        "--for=condition=Established",
        "--timeout=60s",
        "crd/rayclusters.ray.io",
        "crd/rayjobs.ray.io",
        "crd/rayservices.ray.io",
    )
