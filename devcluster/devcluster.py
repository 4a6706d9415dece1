#!/usr/bin/env python3
"""The local control plane: real etcd, kube-apiserver, controller-manager, scheduler, KWOK and KubeRay.

Builds each component from the Go module proxy (cached under the user's cache directory), starts them
as background processes on loopback, and tears them down. Standard library only, so it runs before
the project's virtualenv exists. It never downloads a release binary.

    python3 devcluster/devcluster.py build|up|down|status|env|restart|kueue-up|kueue-down

kueue-up starts Kueue (issue 16) in a running control plane; kueue-down stops it and removes its webhooks.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import node

ROOT = Path(__file__).resolve().parents[1]
GO_DIR = Path(__file__).resolve().parent / "go"
STATE = Path(os.environ.get("RLHF_CLUSTER_DIR", ROOT / ".cluster"))
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "rlhf-operator"

KUBERNETES_VERSION = "v1.36.3"
HOST = "127.0.0.1"
TOKEN_USER = "rlhf-admin"


@dataclass(frozen=True)
class Binary:
    """One Go command built from a wrapper module under devcluster/go/."""

    name: str
    module_dir: str
    package: str
    ldflags: str = ""
    tags: str = ""  # go build -tags


def _k8s_ldflags(version: str = KUBERNETES_VERSION) -> str:
    minor = version.split(".")[1]
    pkg = "k8s.io/component-base/version"
    return " ".join(
        [
            "-s -w",
            f"-X {pkg}.gitVersion={version}",
            f"-X {pkg}.gitMajor=1",
            f"-X {pkg}.gitMinor={minor}",
            f"-X {pkg}.gitTreeState=clean",
            f"-X {pkg}.buildDate=1970-01-01T00:00:00Z",
        ]
    )


def _helm_ldflags() -> str:
    """Helm's own release flags: its version, and the Kubernetes version `helm template` assumes without
    --kube-version (unset, Helm says 1.20 and the chart's kubeVersion refuses it). We say the cluster's."""
    minor = KUBERNETES_VERSION.split(".")[1]
    return " ".join(
        [
            "-s -w",
            "-X helm.sh/helm/v3/internal/version.version=v3.22.0",
            "-X helm.sh/helm/v3/internal/version.gitTreeState=clean",
            *(f"-X helm.sh/helm/v3/pkg/{pkg}.k8sVersionMajor=1" for pkg in ("lint/rules", "chartutil")),
            *(f"-X helm.sh/helm/v3/pkg/{pkg}.k8sVersionMinor={minor}" for pkg in ("lint/rules", "chartutil")),
        ]
    )


def _go_mod_version(module_dir: str, module: str) -> str:
    """The version that a wrapper module's go.mod pins for `module`: the one place a pin is written."""
    for line in (GO_DIR / module_dir / "go.mod").read_text().splitlines():
        words = line.split()
        if words[:1] == ["require"]:
            words = words[1:]
        if len(words) >= 2 and words[0] == module:
            return words[1]
    raise RuntimeError(f"{GO_DIR / module_dir / 'go.mod'} does not require {module}")


KUEUE_MODULE = "sigs.k8s.io/kueue"


def _kueue_ldflags() -> str:
    pkg = f"{KUEUE_MODULE}/pkg/version"
    version = _go_mod_version("kueue", KUEUE_MODULE)
    return (
        f"-s -w -X {pkg}.GitVersion={version} -X {pkg}.GitCommit=module-proxy"
        f" -X {pkg}.BuildDate=1970-01-01T00:00:00Z"
    )


BINARIES = [
    Binary("etcd", "etcd", ".", "-s -w"),
    Binary("kube-apiserver", "kubernetes", "k8s.io/kubernetes/cmd/kube-apiserver", _k8s_ldflags()),
    Binary(
        "kube-controller-manager",
        "kubernetes",
        "k8s.io/kubernetes/cmd/kube-controller-manager",
        _k8s_ldflags(),
    ),
    Binary("kube-scheduler", "kubernetes", "k8s.io/kubernetes/cmd/kube-scheduler", _k8s_ldflags()),
    Binary("kubectl", "kubernetes", "k8s.io/kubernetes/cmd/kubectl", _k8s_ldflags()),
    # The real node (issue 14): a kubelet over Debian's containerd, kube-proxy, and cluster DNS.
    Binary("kubelet", "kubernetes", "k8s.io/kubernetes/cmd/kubelet", _k8s_ldflags()),
    Binary("kube-proxy", "kubernetes", "k8s.io/kubernetes/cmd/kube-proxy", _k8s_ldflags()),
    Binary("coredns", "coredns", ".", "-s -w"),
    Binary("kwok", "kwok", "sigs.k8s.io/kwok/cmd/kwok", "-s -w"),
    Binary("ray-operator", "kuberay", "github.com/ray-project/kuberay/ray-operator", "-s -w"),
    Binary("helm", "helm", "helm.sh/helm/v3/cmd/helm", _helm_ldflags()),
    # The alerting tests' Prometheus: Debian's 2.42 has no Kubernetes service discovery (docs/monitoring.md).
    Binary(
        "prometheus",
        "prometheus",
        "github.com/prometheus/prometheus/cmd/prometheus",
        "-s -w -X github.com/prometheus/common/version.Version=3.16.0"
        " -X github.com/prometheus/common/version.Revision=v0.316.0"
        " -X github.com/prometheus/common/version.Branch=module-proxy",
        # Only the service discovery the tests use (Prometheus' own build tags): minutes less to build.
        tags="remove_all_sd,enable_kubernetes_sd",
    ),
    # The lowest Kubernetes the chart claims (kubeVersion >=1.30): tests/e2e/cluster/test_kubernetes_floor.py
    # runs the RLHFJob CRD against it. Its own module, so the main binaries keep their build key; Go 1.26
    # builds the 1.30 tree as it is (no -checklinkname=0 needed).
    Binary(
        "kube-apiserver-floor",
        "kubernetes-floor",
        "k8s.io/kubernetes/cmd/kube-apiserver",
        _k8s_ldflags("v1.30.14"),
    ),
    # Kueue (issue 16): quota and admission for RayClusters, started on demand by `kueue-up`.
    Binary("kueue", "kueue", f"{KUEUE_MODULE}/cmd/kueue", _kueue_ldflags()),
]


# Each binary's cold build alone on this 2-core machine, in seconds (docs/development.md's table; the
# Kubernetes ones after kube-apiserver reuse its packages): what `build --plan` adds up for the ones the
# cache lacks, so a caller can say how long is left.
COLD_BUILD_S = {
    "etcd": 95,
    "kube-apiserver": 374,
    "kube-controller-manager": 172,
    "kube-scheduler": 38,
    "kubectl": 116,
    "kubelet": 180,
    "kube-proxy": 60,
    "coredns": 118,
    "kwok": 261,
    "ray-operator": 113,
    "helm": 233,
    "prometheus": 353,
    "kube-apiserver-floor": 758,
    "kueue": 459,
}


CONTROL_PLANE_BINARIES = (
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kubectl",
    "kwok",
    "ray-operator",
    "helm",
)


# Built for tests only, not run by `up`: Prometheus (the alerting stage), the floor API server and Kueue
# (`kueue-up`, the kueue fixture).
TEST_BINARIES = ("prometheus", "kube-apiserver-floor", "kueue")
# Started on demand into a running control plane (`kueue-up`), stopped by `kueue-down` or `down`; a dead
# one is dropped by `up` instead of restarting the control plane.
OPTIONAL_COMPONENTS = ("kueue",)
NODE_BINARIES = ("kubelet", "kube-proxy", "coredns")


def up_binaries(real_node: bool) -> list[str]:
    """What `up` runs, plus kubectl and helm: not the test-only binaries."""
    return [*CONTROL_PLANE_BINARIES, *(NODE_BINARIES if real_node else ())]


def binary_names(groups: Iterable[str]) -> list[str] | None:
    """`build`'s arguments: binary names or the groups `up` (what `up` runs) and `test` (TEST_BINARIES);
    none means every binary."""
    names: list[str] = []
    for g in groups:
        if g == "up":
            names += up_binaries(node.enabled())
        elif g == "test":
            names += TEST_BINARIES
        elif any(b.name == g for b in BINARIES):
            names.append(g)
        else:
            raise ClusterError(
                f"build: unknown binary or group {g!r} (groups: up, test; binaries: "
                + ", ".join(b.name for b in BINARIES)
                + ")"
            )
    return names or None


@dataclass
class Component:
    """A process of the control plane: how to start it, where it listens, and how to tell it is healthy."""

    name: str
    args: list[str]
    ports: list[int]
    health_url: str
    env: dict[str, str] = field(default_factory=dict)


class ClusterError(RuntimeError):
    """A failure the user can act on; the message says what and how."""


# ---------------------------------------------------------------------------------------------- build


def _go() -> str:
    go = shutil.which("go") or ("/usr/local/go/bin/go" if Path("/usr/local/go/bin/go").exists() else None)
    if not go:
        raise ClusterError(
            "Go toolchain not found: the local control plane is built from the Go module proxy.\n"
            "Install Go >= 1.26 (https://go.dev/doc/install, or Debian's golang-go if recent enough) "
            "and make sure `go` is on PATH."
        )
    return go


def _build_key(binary: Binary, go: str) -> str:
    """Cache key: Go version, wrapper module content and link flags, so a pin change rebuilds."""
    h = hashlib.sha256()
    h.update(subprocess.run([go, "version"], capture_output=True, text=True, check=True).stdout.encode())
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
    go = _go()
    (STATE / "bin").mkdir(parents=True, exist_ok=True)
    out: dict[str, Path] = {}
    env = dict(os.environ)
    # go.sum is committed for every wrapper module: verify against it, never fetch a checksum database.
    env.setdefault("GOFLAGS", "-mod=readonly")
    env["GOFLAGS"] = env["GOFLAGS"] + " -buildvcs=false"
    env.setdefault("GOSUMDB", "off")
    env.setdefault("CGO_ENABLED", "0")
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
            cmd = [go, "build", *tags, "-ldflags", binary.ldflags, "-o", str(tmp), binary.package]
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
    go = _go()
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
    target = _cache_target(binary, _go())
    return _link(name, target) if target.exists() else None


# ---------------------------------------------------------------------------------------------- PKI


def _openssl(*args: str, cwd: Path) -> None:
    if not shutil.which("openssl"):
        raise ClusterError(
            "openssl not found: install Debian's `openssl` package (apt-get install -y openssl)."
        )
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_pki(pki: Path) -> str:
    """A CA, the API server's serving certificate, the service-account key pair and an admin token."""
    pki.mkdir(parents=True, exist_ok=True)
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-days",
        "3650",
        "-subj",
        "/CN=rlhf-local-ca",
        cwd=pki,
    )
    (pki / "server.ext").write_text(
        f"subjectAltName=IP:127.0.0.1,IP:10.96.0.1,IP:{node.GATEWAY},DNS:localhost,DNS:kubernetes,"
        "DNS:kubernetes.default,DNS:kubernetes.default.svc\n"
        "extendedKeyUsage=serverAuth\n"
    )
    _openssl(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
        "-subj",
        "/CN=kube-apiserver",
        cwd=pki,
    )
    _openssl(
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "server.crt",
        "-days",
        "3650",
        "-extfile",
        "server.ext",
        cwd=pki,
    )
    # The API server's client certificate for the kubelet (logs, exec): the kubelet trusts our CA only.
    (pki / "kubelet-client.ext").write_text("extendedKeyUsage=clientAuth\n")
    _openssl(
        "req", "-newkey", "rsa:2048", "-nodes", "-keyout", "kubelet-client.key", "-out", "kubelet-client.csr",
        "-subj", "/O=system:masters/CN=kube-apiserver-kubelet-client", cwd=pki,
    )  # fmt: skip
    _openssl(
        "x509", "-req", "-in", "kubelet-client.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "kubelet-client.crt", "-days", "3650", "-extfile", "kubelet-client.ext", cwd=pki,
    )  # fmt: skip
    _openssl("genrsa", "-out", "sa.key", "2048", cwd=pki)
    _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=pki)
    token = base64.urlsafe_b64encode(os.urandom(24)).decode().rstrip("=")
    (pki / "tokens.csv").write_text(f'{token},{TOKEN_USER},1000,"system:masters"\n')
    (pki / "audit-policy.yaml").write_text(
        "apiVersion: audit.k8s.io/v1\nkind: Policy\nomitStages: [RequestReceived]\nrules:\n"
        "- level: Metadata\n  verbs: [create, update, patch, delete, deletecollection]\n"
        "- level: None\n"
    )
    return token


def write_kubeconfig(path: Path, ca: Path, token: str, port: int) -> None:
    ca_data = base64.b64encode(ca.read_bytes()).decode()
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {
                        "name": "rlhf-local",
                        "cluster": {
                            "server": f"https://{HOST}:{port}",
                            "certificate-authority-data": ca_data,
                        },
                    }
                ],
                "users": [{"name": TOKEN_USER, "user": {"token": token}}],
                "contexts": [
                    {"name": "rlhf-local", "context": {"cluster": "rlhf-local", "user": TOKEN_USER}}
                ],
                "current-context": "rlhf-local",
            },
            indent=2,
        )
    )
    path.chmod(0o600)


# ---------------------------------------------------------------------------------------------- ports


@dataclass(frozen=True)
class Ports:
    etcd_client: int = 23790
    etcd_peer: int = 23800
    apiserver: int = 16443
    controller_manager: int = 20257
    scheduler: int = 20259
    kwok: int = 20247
    kuberay_metrics: int = 20080
    kuberay_health: int = 20081
    # the real node
    kubelet: int = 20250
    kubelet_healthz: int = 20248
    kube_proxy_metrics: int = 20249
    kube_proxy_healthz: int = 20256
    coredns_health: int = 20253
    coredns_ready: int = 20254
    # Kueue, when started (`kueue-up`)
    kueue_webhook: int = 20090
    kueue_health: int = 20091
    kueue_metrics: int = 20092

    @classmethod
    def from_env(cls) -> Ports:
        """RLHF_CLUSTER_PORT_BASE shifts every port, so two checkouts can run side by side."""
        shift = int(os.environ.get("RLHF_CLUSTER_PORT_OFFSET", "0"))
        return cls(**{k: v + shift for k, v in cls().__dict__.items()})


def check_port_free(port: int, owner: str) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((HOST, port))
        except OSError as e:
            raise ClusterError(
                f"port {port} on {HOST} (needed by {owner}) is already in use ({e.strerror}). "
                f"Stop what listens there (`ss -ltnp 'sport = :{port}'`), run `make cluster-down` if it is an "
                "old control plane, or set RLHF_CLUSTER_PORT_OFFSET to move every port."
            ) from None


# ---------------------------------------------------------------------------------------------- processes


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child of ours counts as dead.
    with contextlib.suppress(OSError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        if stat.rsplit(")", 1)[1].split()[0] == "Z":
            return False
    return True


def log_tail(name: str, lines: int = 25) -> str:
    log = STATE / "logs" / f"{name}.log"
    if not log.exists():
        return f"(no log at {log})"
    text = log.read_text(errors="replace").splitlines()
    return "\n".join(f"    {line}" for line in text[-lines:])


def _ssl_context() -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(STATE / "pki" / "ca.crt"))
    return ctx


def _insecure_context() -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def probe(url: str, token: str | None = None) -> bool:
    req = urllib.request.Request(url)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    ctx: ssl.SSLContext | None = None
    if url.startswith("https://"):
        # Controller-manager and scheduler serve self-signed certificates; only the API server is ours.
        ctx = _ssl_context() if token else _insecure_context()
    try:
        with urllib.request.urlopen(req, timeout=3, context=ctx) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError, ssl.SSLError):
        return False


def start(component: Component) -> int:
    log = (STATE / "logs" / f"{component.name}.log").open("ab")
    env = dict(os.environ)
    env.update(component.env)
    proc = subprocess.Popen(
        component.args,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        env=env,
        cwd=STATE,
    )
    return proc.pid


def wait_healthy(component: Component, pid: int, token: str | None, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _pid_alive(pid):
            raise ClusterError(
                f"{component.name} exited during start-up. Last lines of its log:\n{log_tail(component.name)}"
            )
        if probe(component.health_url, token if component.name == "kube-apiserver" else None):
            return
        time.sleep(0.3)
    raise ClusterError(
        f"{component.name} did not become healthy at {component.health_url} in {timeout:.0f}s. "
        f"Last lines of its log:\n{log_tail(component.name)}"
    )


# ---------------------------------------------------------------------------------------------- cluster


def components(bins: dict[str, Path], ports: Ports, real_node: bool = False) -> list[Component]:
    """The control plane's processes in start order; with `real_node`, the node's after them."""
    pki = STATE / "pki"
    kubeconfig = str(STATE / "kubeconfig")
    logs = STATE / "logs"
    # Pods reach the API server through the kubernetes Service, whose endpoint is the node's bridge
    # address; without a real node it listens on loopback only.
    apiserver_net = (
        ["--bind-address=0.0.0.0", f"--advertise-address={node.GATEWAY}"]
        if real_node
        else [f"--bind-address={HOST}", f"--advertise-address={HOST}"]
    )
    control_plane = [
        Component(
            "etcd",
            [
                str(bins["etcd"]),
                "--name=rlhf-local",
                f"--data-dir={STATE / 'etcd'}",
                f"--listen-client-urls=http://{HOST}:{ports.etcd_client}",
                f"--advertise-client-urls=http://{HOST}:{ports.etcd_client}",
                f"--listen-peer-urls=http://{HOST}:{ports.etcd_peer}",
                f"--initial-advertise-peer-urls=http://{HOST}:{ports.etcd_peer}",
                f"--initial-cluster=rlhf-local=http://{HOST}:{ports.etcd_peer}",
                "--unsafe-no-fsync=true",
                "--quota-backend-bytes=4294967296",
                "--log-level=warn",
            ],
            [ports.etcd_client, ports.etcd_peer],
            f"http://{HOST}:{ports.etcd_client}/health",
        ),
        Component(
            "kube-apiserver",
            [
                str(bins["kube-apiserver"]),
                f"--etcd-servers=http://{HOST}:{ports.etcd_client}",
                *apiserver_net,
                f"--secure-port={ports.apiserver}",
                f"--kubelet-client-certificate={pki / 'kubelet-client.crt'}",
                f"--kubelet-client-key={pki / 'kubelet-client.key'}",
                "--kubelet-preferred-address-types=InternalIP",
                f"--tls-cert-file={pki / 'server.crt'}",
                f"--tls-private-key-file={pki / 'server.key'}",
                f"--client-ca-file={pki / 'ca.crt'}",
                f"--token-auth-file={pki / 'tokens.csv'}",
                "--authorization-mode=RBAC",
                "--service-cluster-ip-range=10.96.0.0/16",
                "--service-account-issuer=https://kubernetes.default.svc",
                f"--service-account-key-file={pki / 'sa.pub'}",
                f"--service-account-signing-key-file={pki / 'sa.key'}",
                "--allow-privileged=true",
                "--enable-priority-and-fairness=false",
                f"--audit-policy-file={pki / 'audit-policy.yaml'}",
                f"--audit-log-path={logs / 'audit.log'}",
                "--audit-log-maxsize=200",
                "--audit-log-maxbackup=1",
            ],
            [ports.apiserver],
            f"https://{HOST}:{ports.apiserver}/readyz",
        ),
        Component(
            "kube-controller-manager",
            [
                str(bins["kube-controller-manager"]),
                f"--kubeconfig={kubeconfig}",
                f"--authentication-kubeconfig={kubeconfig}",
                f"--authorization-kubeconfig={kubeconfig}",
                f"--bind-address={HOST}",
                f"--secure-port={ports.controller_manager}",
                f"--service-account-private-key-file={pki / 'sa.key'}",
                f"--root-ca-file={pki / 'ca.crt'}",
                "--leader-elect=false",
                "--use-service-account-credentials=false",
                "--controllers=*,-nodeipam,-nodelifecycle,-cloud-node-lifecycle,-service-lb-controller,"
                "-route,-attachdetach,-persistentvolume-expander",
                "--concurrent-gc-syncs=10",
            ],
            [ports.controller_manager],
            f"https://{HOST}:{ports.controller_manager}/healthz",
        ),
        Component(
            "kube-scheduler",
            [
                str(bins["kube-scheduler"]),
                f"--kubeconfig={kubeconfig}",
                f"--authentication-kubeconfig={kubeconfig}",
                f"--authorization-kubeconfig={kubeconfig}",
                f"--bind-address={HOST}",
                f"--secure-port={ports.scheduler}",
                "--leader-elect=false",
            ],
            [ports.scheduler],
            f"https://{HOST}:{ports.scheduler}/healthz",
        ),
        Component(
            "kwok",
            [
                str(bins["kwok"]),
                f"--kubeconfig={kubeconfig}",
                f"--config={write_kwok_stages()}",
                "--manage-all-nodes=false",
                "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake",
                "--manage-nodes-with-label-selector=",
                "--manage-single-node=",
                "--cidr=10.0.0.0/16",
                "--node-ip=10.0.0.1",
                "--node-lease-duration-seconds=40",
                f"--server-address={HOST}:{ports.kwok}",
            ],
            [ports.kwok],
            f"http://{HOST}:{ports.kwok}/healthz",
        ),
        Component(
            "kuberay-operator",
            [
                str(bins["ray-operator"]),
                f"--metrics-addr={HOST}:{ports.kuberay_metrics}",
                f"--health-probe-bind-address={HOST}:{ports.kuberay_health}",
                "--enable-leader-election=false",
                "--log-stdout-encoder=console",
                # more KubeRay flags, e.g. --reconcile-concurrency=8 (benchmarks/operator_scale.py)
                *shlex.split(os.environ.get("RLHF_KUBERAY_ARGS", "")),
            ],
            [ports.kuberay_metrics, ports.kuberay_health],
            f"http://{HOST}:{ports.kuberay_health}/readyz",
            env={"KUBECONFIG": kubeconfig},
        ),
    ]
    return control_plane + (node_components(bins, ports) if real_node else [])


def node_components(bins: dict[str, Path], ports: Ports) -> list[Component]:
    """The real node's processes (containerd is started before them by images/build_images.py)."""
    paths = node.NodePaths(STATE / "node")
    kubeconfig = str(STATE / "kubeconfig")
    return [
        Component(
            "kubelet",
            [
                str(bins["kubelet"]),
                f"--config={paths.kubelet_config}",
                f"--kubeconfig={kubeconfig}",
                f"--hostname-override={node.NODE_NAME}",
                f"--node-ip={node.GATEWAY}",
                f"--root-dir={paths.kubelet_root}",
                f"--cert-dir={paths.root / 'kubelet-pki'}",
                f"--node-labels={node.NODE_LABEL[0]}={node.NODE_LABEL[1]}",
            ],
            [ports.kubelet, ports.kubelet_healthz],
            f"http://{HOST}:{ports.kubelet_healthz}/healthz",
        ),
        Component(
            "kube-proxy",
            [str(bins["kube-proxy"]), f"--config={paths.kube_proxy_config}"],
            [ports.kube_proxy_metrics, ports.kube_proxy_healthz],
            f"http://{HOST}:{ports.kube_proxy_metrics}/metrics",
        ),
        Component(
            "coredns",
            [str(bins["coredns"]), "-conf", str(paths.corefile)],
            [ports.coredns_health, ports.coredns_ready],
            f"http://{HOST}:{ports.coredns_ready}/ready",
        ),
    ]


# KWOK plays the kubelet through "stages": rules that match an object and write its next status.
# Ours are the three a kubelet would do for these tests, nothing more: mark a fake node Ready,
# move a scheduled pod straight to Running (no image pulls exist here), and finish a deletion.
KWOK_STAGES = """\
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata: {name: rlhf-node-ready}
spec:
  resourceRef: {apiGroup: v1, kind: Node}
  selector:
    matchExpressions:
    - {key: '.status.phase', operator: 'NotIn', values: ['Running']}
  next:
    statusTemplate: |
      {{ $now := Now }}
      conditions:
      - {type: Ready, status: "True", reason: KwokReady, message: "fake kubelet (KWOK)", lastHeartbeatTime: {{ $now | Quote }}, lastTransitionTime: {{ $now | Quote }}}
      - {type: MemoryPressure, status: "False", reason: KwokReady, message: "", lastHeartbeatTime: {{ $now | Quote }}, lastTransitionTime: {{ $now | Quote }}}
      - {type: DiskPressure, status: "False", reason: KwokReady, message: "", lastHeartbeatTime: {{ $now | Quote }}, lastTransitionTime: {{ $now | Quote }}}
      - {type: PIDPressure, status: "False", reason: KwokReady, message: "", lastHeartbeatTime: {{ $now | Quote }}, lastTransitionTime: {{ $now | Quote }}}
      addresses:
      - {type: InternalIP, address: {{ NodeIP | Quote }}}
      - {type: Hostname, address: {{ NodeName | Quote }}}
      allocatable:
      {{ YAML .status.allocatable 1 }}
      capacity:
      {{ YAML .status.capacity 1 }}
      nodeInfo:
        architecture: amd64
        operatingSystem: linux
        kubeletVersion: {{ printf "kwok-%s" Version | Quote }}
        containerRuntimeVersion: {{ printf "kwok-%s" Version | Quote }}
        kernelVersion: ""
        kubeProxyVersion: ""
        osImage: ""
        machineID: ""
        bootID: ""
        systemUUID: ""
      phase: Running
---
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata: {name: rlhf-pod-running}
spec:
  resourceRef: {apiGroup: v1, kind: Pod}
  selector:
    matchExpressions:
    - {key: '.metadata.deletionTimestamp', operator: 'DoesNotExist'}
    - {key: '.status.podIP', operator: 'DoesNotExist'}
  next:
    statusTemplate: |
      {{ $now := Now }}
      conditions:
      {{ range (list "PodScheduled" "Initialized" "ContainersReady" "Ready") }}
      - {type: {{ . }}, status: "True", lastProbeTime: null, lastTransitionTime: {{ $now | Quote }}}
      {{ end }}
      containerStatuses:
      {{ range .spec.containers }}
      - name: {{ .name | Quote }}
        image: {{ .image | Quote }}
        ready: true
        started: true
        restartCount: 0
        state: {running: {startedAt: {{ $now | Quote }}}}
      {{ end }}
      hostIP: {{ NodeIPWith .spec.nodeName | Quote }}
      podIP: {{ PodIPWith .spec.nodeName ( or .spec.hostNetwork false ) ( or .metadata.uid "" ) ( or .metadata.name "" ) ( or .metadata.namespace "" ) | Quote }}
      phase: Running
      startTime: {{ $now | Quote }}
---
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata: {name: rlhf-pod-delete}
spec:
  resourceRef: {apiGroup: v1, kind: Pod}
  selector:
    matchExpressions:
    - {key: '.metadata.deletionTimestamp', operator: 'Exists'}
    - {key: '.metadata.finalizers', operator: 'DoesNotExist'}
  next:
    delete: true
"""


def write_kwok_stages() -> Path:
    path = STATE / "kwok-stages.yaml"
    path.write_text(KWOK_STAGES)
    return path


NODES = 2


def node_manifest(i: int) -> dict[str, object]:
    resources = {"cpu": "64", "memory": "512Gi", "pods": "110", "nvidia.com/gpu": "8"}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": f"kwok-gpu-{i}",
            "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
            "labels": {
                "kubernetes.io/hostname": f"kwok-gpu-{i}",
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "type": "kwok",
                "nvidia.com/gpu.product": "FAKE-GPU-80GB",
            },
        },
        "spec": {},
        "status": {"capacity": resources, "allocatable": resources},
    }


def kubectl(*args: str, input: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    cmd = [str(binary_path("kubectl")), f"--kubeconfig={STATE / 'kubeconfig'}", *args]
    proc = subprocess.run(cmd, input=input, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise ClusterError(f"kubectl {' '.join(args)} failed:\n{proc.stderr}")
    return proc


def module_dir(wrapper: str, module: str) -> Path:
    """Where the Go module cache holds `module` at the version the wrapper module `wrapper` pins
    (downloaded first if missing): the CRDs and manifests are read from there, never copied here."""
    cmd = [_go(), "list", "-m", "-json", module]
    env = {**os.environ, "GOFLAGS": "-mod=readonly"}
    proc = subprocess.run(cmd, cwd=GO_DIR / wrapper, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise ClusterError(f"cannot locate the module {module}: {proc.stderr}")
    mod_dir = json.loads(proc.stdout).get("Dir")
    if not mod_dir:
        subprocess.run([_go(), "mod", "download", module], cwd=GO_DIR / wrapper, check=True, env=env)
        return module_dir(wrapper, module)
    return Path(mod_dir)


def kuberay_crd_dir() -> Path:
    """KubeRay's CRDs, read from the Go module cache at the pinned version (never copied into the repo)."""
    return module_dir("kuberay", "github.com/ray-project/kuberay/ray-operator") / "config" / "crd" / "bases"


def read_state() -> dict[str, object] | None:
    path = STATE / "state.json"
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else None
    except json.JSONDecodeError:
        return None


def running_status() -> dict[str, bool]:
    state = read_state() or {}
    pids = state.get("pids", {})
    assert isinstance(pids, dict)
    return {name: _pid_alive(int(pid)) for name, pid in pids.items()}


def _forget_dead_optional() -> None:
    state = read_state()
    if not state:
        return
    pids = state.get("pids", {})
    assert isinstance(pids, dict)
    dead = [n for n in OPTIONAL_COMPONENTS if n in pids and not _pid_alive(int(pids[n]))]
    for name in dead:
        print(f"[up] {name} had stopped; last lines of its log:\n{log_tail(name)}", file=sys.stderr)
        if name == "kueue":
            kueue_down(quiet=True)
        pids.pop(name, None)
    if dead:
        _save_state(state)


def up() -> None:
    started_at = time.monotonic()
    _forget_dead_optional()
    status = running_status()
    if status and all(status.values()):
        token = str((read_state() or {}).get("token", ""))
        port = _cluster_ports(read_state() or {}).apiserver
        if probe(f"https://{HOST}:{port}/readyz", token):
            print(
                f"control plane already running ({len(status)} components); kubeconfig: {STATE / 'kubeconfig'}"
            )
            return
    if status:
        dead = [n for n, alive in status.items() if not alive]
        for name in dead:
            print(f"[up] {name} is not running. Last lines of its log:\n{log_tail(name)}", file=sys.stderr)
        print("[up] restarting the control plane from scratch", file=sys.stderr)
        down(quiet=True)

    real_node = node.enabled()
    if real_node:
        node.install_packages()
        problems = node.missing_prerequisites()
        if problems:
            raise ClusterError(
                "the real node cannot run on this machine: missing " + "; ".join(problems) + ".\n"
                "Set RLHF_REAL_NODE=0 to start the control plane with KWOK nodes only."
            )
    bins = build(names=up_binaries(real_node))
    ports = Ports.from_env()
    comps = components(bins, ports, real_node)
    for comp in comps:
        for port in comp.ports:
            check_port_free(port, comp.name)

    for sub in ("logs", "etcd"):
        (STATE / sub).mkdir(parents=True, exist_ok=True)
    token = make_pki(STATE / "pki")
    write_kubeconfig(STATE / "kubeconfig", STATE / "pki" / "ca.crt", token, ports.apiserver)

    pids: dict[str, int] = {}
    state: dict[str, object] = {"pids": pids, "token": token, "ports": ports.__dict__, "real_node": real_node}

    def save() -> None:
        (STATE / "state.json").write_text(json.dumps(state, indent=2))

    try:
        for comp in comps:
            t0 = time.monotonic()
            if comp.name == "kubelet":
                pids["containerd"] = _prepare_real_node(ports)
                save()
            pids[comp.name] = start(comp)
            save()
            if comp.name == "kuberay-operator":
                _install_kuberay_crds()
            wait_healthy(comp, pids[comp.name], token)
            print(
                f"[up] {comp.name:<24} healthy in {time.monotonic() - t0:5.1f}s  (pid {pids[comp.name]})",
                flush=True,
            )
            if comp.name == "kube-apiserver":
                _wait_default_objects()
            if comp.name == "kuberay-operator":
                _register_nodes()
            if comp.name == "kubelet":
                _wait_real_node_ready()
                kubectl(
                    "apply",
                    "-f",
                    "-",
                    input=json.dumps({"kind": "List", "apiVersion": "v1", "items": node.dns_objects()}),
                )
    except BaseException:
        down(quiet=True, keep_logs=True)
        raise
    print(
        f"[up] control plane ready in {time.monotonic() - started_at:.1f}s; "
        f"export KUBECONFIG={STATE / 'kubeconfig'}; logs in {STATE / 'logs'}"
    )


def _prepare_real_node(ports: Ports) -> int:
    """containerd with the pause image, the bridge network and the node's configuration files;
    returns containerd's pid."""
    t0 = time.monotonic()
    paths = node.NodePaths(STATE / "node")
    other = node.other_node(paths.kubelet_root)
    if other:
        raise ClusterError(
            f"another cluster's real node runs on this machine (kubelet root {other}); one real node per "
            "machine: stop that cluster (make cluster-down, or the demo), or set RLHF_REAL_NODE=0"
        )
    pid, socket, cni_conf_dir = node.runtime_up()
    node.setup_network(paths, cni_conf_dir)
    node.write_configs(paths, STATE / "pki" / "ca.crt", STATE / "kubeconfig", socket, ports.__dict__)
    print(
        f"[up] {'containerd':<24} ready in {time.monotonic() - t0:5.1f}s  (pid {pid}; bridge {node.BRIDGE})"
    )
    return pid


def _wait_real_node_ready(timeout: float = 120) -> None:
    """The kubelet's node is Ready; the not-ready taint that admission put on it is lifted (the node
    lifecycle controller, which would, is off here), and its own taint keeps other pods away."""
    name = f"node/{node.NODE_NAME}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if kubectl("get", name, check=False).returncode == 0:
            break
        time.sleep(0.5)
    proc = kubectl(
        "wait",
        "--for=condition=Ready",
        f"--timeout={int(max(1, deadline - time.monotonic()))}s",
        name,
        check=False,
    )
    if proc.returncode != 0:
        raise ClusterError(
            f"the real node {node.NODE_NAME} did not become Ready:\n{proc.stderr}\n{log_tail('kubelet', 40)}"
        )
    kubectl("taint", "nodes", node.NODE_NAME, "node.kubernetes.io/not-ready:NoSchedule-", check=False)
    # The GPU stand-in: the node advertises GPUs it does not have (an extended resource patched into its
    # status, as Kubernetes documents for advertising one), so jobs sized in GPUs schedule here; their
    # ranks run on the CPU, where the trainer's device detection sends them.
    patch = {"status": {"capacity": {node.GPU_RESOURCE: str(node.STAND_IN_GPUS)}}}
    kubectl("patch", "node", node.NODE_NAME, "--subresource=status", "--type=merge", "-p", json.dumps(patch))


def _drain_real_node(timeout: float = 30) -> None:
    """Deletes the real node's pods while its kubelet still runs, so it stops their containers and
    releases their addresses (CNI DEL) before the node goes."""
    kubectl(
        "delete", "pods", "--all-namespaces", f"--field-selector=spec.nodeName={node.NODE_NAME}",
        "--grace-period=0", "--force", "--wait=false", check=False,
    )  # fmt: skip
    socket = node.runtime_socket()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and node.running_tasks(socket):
        time.sleep(1)


def restart(name: str) -> float:
    """Stop one running component (SIGTERM, then SIGKILL) and start it again with the same arguments and
    ports; returns the seconds until it was healthy again. For fault-injection tests."""
    state = read_state()
    if not state:
        raise ClusterError("the control plane is not running (make cluster-up)")
    pids = state["pids"]
    assert isinstance(pids, dict)
    if name not in pids:
        raise ClusterError(f"no component {name!r}; components: {', '.join(pids)}")
    if name == "kueue":
        raise ClusterError("restart Kueue with kueue-down then kueue-up")
    ports = Ports(**state["ports"])  # type: ignore[arg-type]
    bins = {b.name: binary_path(b.name) for b in BINARIES}
    comps = components(bins, ports, bool(state.get("real_node")))
    comp = next(c for c in comps if c.name == name)
    t0 = time.monotonic()
    _stop(int(pids[name]))
    pids[name] = start(comp)
    (STATE / "state.json").write_text(json.dumps(state, indent=2))
    wait_healthy(comp, int(pids[name]), str(state.get("token", "")))
    return time.monotonic() - t0


def _wait_default_objects() -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if kubectl("get", "namespace", "default", check=False).returncode == 0:
            return
        time.sleep(0.5)
    raise ClusterError(
        "the API server did not create the default namespace in 60s:\n" + log_tail("kube-apiserver")
    )


def _install_kuberay_crds() -> None:
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


def _register_nodes() -> None:
    register_nodes(range(NODES))


def register_nodes(indices: Iterable[int]) -> None:
    """Add (or re-add) KWOK GPU nodes kwok-gpu-<i>, Ready and schedulable (tests add more, or a lost one)."""
    indices = list(indices)
    for i in indices:
        kubectl("apply", "-f", "-", input=json.dumps(node_manifest(i)))
    names = [f"node/kwok-gpu-{i}" for i in indices]
    kubectl("wait", "--for=condition=Ready", "--timeout=60s", *names)
    # The TaintNodesByCondition admission plugin gives every new node the not-ready taint, and the node
    # lifecycle controller (off here: KWOK's leases are the only heartbeat) is what would lift it.
    for name in names:
        proc = kubectl(
            "taint", "nodes", name.split("/", 1)[1], "node.kubernetes.io/not-ready:NoSchedule-", check=False
        )
        if proc.returncode != 0 and "not found" not in proc.stderr:
            raise ClusterError(f"removing the not-ready taint of {name}: {proc.stderr}")


def down(quiet: bool = False, keep_logs: bool = False) -> None:
    state = read_state() or {}
    pids = state.get("pids", {})
    assert isinstance(pids, dict)
    real_node = bool(state.get("real_node")) and "containerd" in pids  # ours to tear down
    if (
        real_node
        and _pid_alive(int(pids.get("kubelet", 0) or 0))
        and _pid_alive(int(pids.get("kube-apiserver", 0) or 0))
    ):
        _drain_real_node()
    for name, pid in reversed(list(pids.items())):
        if name == "containerd":
            left = node.kill_containers(node.runtime_socket())
            node.runtime_down()
            if not quiet:
                print(f"[down] stopped containerd ({left} containers were still running)")
            continue
        _stop(int(pid))
        if not quiet:
            print(f"[down] stopped {name}")
    if real_node:
        if binary_path("kube-proxy").exists():
            subprocess.run([str(binary_path("kube-proxy")), "--cleanup"], capture_output=True, timeout=60)
        node.unmount_under(STATE / "node")
        node.teardown_network()
    for sub in ("etcd", "pki", "state.json", "kubeconfig", "node") + (() if keep_logs else ("logs",)):
        path = STATE / sub
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        elif path.exists():
            path.unlink()
    if not quiet:
        print("[down] control plane stopped and state removed")


def _stop(pid: int) -> None:
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if not _pid_alive(pid):
                return
            time.sleep(0.1)


def status() -> int:
    st = running_status()
    if not st:
        print("control plane: not running")
        return 1
    bad = 0
    for name, alive in st.items():
        print(f"{name:<24} {'running' if alive else 'DEAD'}")
        if not alive:
            bad += 1
            print(log_tail(name))
    return 1 if bad else 0


# ---------------------------------------------------------------------------------------------- Kueue
# Kueue (issue 16) is not part of `up`: `kueue-up` starts it against a running control plane, with its
# CRDs and webhook manifests read from the Go module cache at the pinned version, its webhook served on
# loopback with a certificate from the cluster's CA, and the API server calling it by URL (no Service).

KUEUE_NAMESPACE = "kueue-system"
# The jobs Kueue manages here, as its Configuration names them ("<group>/<kind>"); only labelled ones
# (kueue.x-k8s.io/queue-name), since manageJobsWithoutQueueName is false.
KUEUE_FRAMEWORKS = ("ray.io/raycluster", "ray.io/rayjob", "batch/job")
KUEUE_FEATURE_GATES = {
    # Alpha (off by default): a RayCluster annotated kueue.x-k8s.io/elastic-job: "true" may change its
    # worker replicas while admitted (a new Workload slice replaces the old one) and may use the autoscaler.
    "ElasticJobsViaWorkloadSlices": True,
    # The visibility API server (beta, on by default) would bind 0.0.0.0:8082 and read its certificate
    # from /visibility; nothing here uses it.
    "VisibilityOnDemand": False,
}
# The configurations' names as Kueue's release manifests have them (its kustomization's namePrefix).
KUEUE_WEBHOOK_CONFIGS = {
    "MutatingWebhookConfiguration": "kueue-mutating-webhook-configuration",
    "ValidatingWebhookConfiguration": "kueue-validating-webhook-configuration",
}
# Without internal certificate management Kueue reads its metrics serving certificate from this fixed
# path (cmd/kueue/main.go), and exits at start-up when it is missing: no flag or field moves it.
KUEUE_METRICS_CERT_DIR = Path("/etc/kueue/metrics/certs")


def kueue_module_dir() -> Path:
    return module_dir("kueue", KUEUE_MODULE)


def _cluster_ports(state: dict[str, object]) -> Ports:
    """The running cluster's ports; those its state lacks (a cluster started before they existed) from
    the environment, as `up` would have chosen them."""
    saved = state.get("ports", {})
    assert isinstance(saved, dict)
    known = Ports.from_env().__dict__
    return Ports(**{**known, **{k: int(v) for k, v in saved.items() if k in known}})


def _save_state(state: dict[str, object]) -> None:
    (STATE / "state.json").write_text(json.dumps(state, indent=2))


def _kueue_component(binary: Path, config: Path, ports: Ports) -> Component:
    return Component(
        "kueue",
        [str(binary), f"--config={config}", f"--kubeconfig={STATE / 'kubeconfig'}"],
        [ports.kueue_webhook, ports.kueue_health, ports.kueue_metrics],
        # Ready once its webhook server listens (cmd/kueue/main.go's readyz check).
        f"http://{HOST}:{ports.kueue_health}/readyz",
    )


def _kueue_pki(kdir: Path) -> str:
    """The webhook's serving certificate (tls.crt/tls.key, as controller-runtime reads them from certDir),
    signed by the cluster's CA for 127.0.0.1 and localhost; returns the CA bundle (base64) the API server
    is to trust."""
    pki = STATE / "pki"
    certs = kdir / "certs"
    certs.mkdir(parents=True, exist_ok=True)
    (certs / "server.ext").write_text(
        f"subjectAltName=IP:{HOST},DNS:localhost,DNS:kueue-webhook-service.{KUEUE_NAMESPACE}.svc\n"
        "extendedKeyUsage=serverAuth\n"
    )
    _openssl(
        "req", "-newkey", "rsa:2048", "-nodes", "-keyout", "tls.key", "-out", "tls.csr",
        "-subj", "/CN=kueue-webhook", cwd=certs,
    )  # fmt: skip
    _openssl(
        "x509", "-req", "-in", "tls.csr", "-CA", str(pki / "ca.crt"), "-CAkey", str(pki / "ca.key"),
        "-CAcreateserial", "-CAserial", str(certs / "ca.srl"), "-out", "tls.crt", "-days", "3650",
        "-extfile", "server.ext", cwd=certs,
    )  # fmt: skip
    _kueue_metrics_certs(certs)
    return base64.b64encode((pki / "ca.crt").read_bytes()).decode()


def _kueue_metrics_certs(certs: Path) -> None:
    """Kueue's fixed metrics certificate path gets a certificate if it has none (any valid pair serves:
    its metrics endpoint authenticates callers by token, not by this certificate)."""
    target = KUEUE_METRICS_CERT_DIR
    if (target / "tls.crt").is_file() and (target / "tls.key").is_file():
        return
    try:
        target.mkdir(parents=True, exist_ok=True)
        for name in ("tls.crt", "tls.key"):
            shutil.copyfile(certs / name, target / name)
        (target / "tls.key").chmod(0o600)
    except OSError as e:
        raise ClusterError(
            f"Kueue reads its metrics certificate from {target} (a fixed path when it does not manage "
            f"certificates itself) and cannot start without one; writing it failed ({e}). Run kueue-up "
            f"as root once, or copy {certs}/tls.crt and tls.key there."
        ) from None


def _manifests_json(path: Path) -> list[dict[str, object]]:
    """A YAML manifest file as JSON objects, converted by kubectl (the standard library reads no YAML)."""
    text = kubectl("create", "--dry-run=client", "--validate=false", "-o", "json", "-f", str(path)).stdout
    decoder, objs, pos = json.JSONDecoder(), [], 0
    while text[pos:].strip():  # one JSON document per object, one after the other
        obj, end = decoder.raw_decode(text[pos:].lstrip())
        pos = len(text) - len(text[pos:].lstrip()) + end
        objs.append(obj)
    return [o for o in objs if isinstance(o, dict)]


def _install_kueue_crds(mod: Path, ca_bundle: str, ports: Ports) -> None:
    """Kueue's CRDs, server-side applied (they are too large for a client-side apply's annotation); the
    five that Kueue's kustomization converts between v1beta1 and v1beta2 get its /convert webhook."""
    crd_dir = mod / "config" / "components" / "crd"
    files = sorted((crd_dir / "bases").glob("*.yaml"))
    if not files:
        raise ClusterError(f"no Kueue CRDs found in {crd_dir / 'bases'}")
    kubectl("apply", "--server-side", "--force-conflicts", *(f"--filename={f}" for f in files))
    # The kustomization's own list: patches/ holds more webhook_in_*.yaml than it applies (ResourceFlavor's,
    # whose types have no conversion: the API server's reads of v1beta1 then fail in the webhook).
    kustomization = (crd_dir / "kustomization.yaml").read_text()
    listed = re.findall(r"^\s*-\s*path:\s*(patches/webhook_in_\S+\.yaml)\s*$", kustomization, re.MULTILINE)
    if not listed:
        raise ClusterError(f"no conversion patches listed in {crd_dir / 'kustomization.yaml'}")
    converted = []
    for patch in listed:
        for obj in _manifests_json(crd_dir / patch):
            meta = obj.get("metadata", {})
            assert isinstance(meta, dict)
            converted.append(str(meta["name"]))
    webhook = {
        "clientConfig": {"url": f"https://{HOST}:{ports.kueue_webhook}/convert", "caBundle": ca_bundle},
        "conversionReviewVersions": ["v1"],
    }
    names = [f"{f.name.split('_', 1)[1].removesuffix('.yaml')}.kueue.x-k8s.io" for f in files]
    for name in names:  # the others explicitly None: a patch of an earlier kueue-up outlives the apply
        conversion: dict[str, object] = {"strategy": "None", "webhook": None}
        if name in converted:
            conversion = {"strategy": "Webhook", "webhook": webhook}
        kubectl("patch", "crd", name, "--type=merge", "-p", json.dumps({"spec": {"conversion": conversion}}))
    names = [f"crd/{n}" for n in names]
    kubectl("wait", "--for=condition=Established", "--timeout=60s", *names)


def kueue_config(ports: Ports, cert_dir: Path) -> dict[str, object]:
    """Kueue's Configuration (config.kueue.x-k8s.io/v1beta2, the version v0.17 loads)."""
    return {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2",
        "kind": "Configuration",
        "namespace": KUEUE_NAMESPACE,
        "manageJobsWithoutQueueName": False,
        "leaderElection": {"leaderElect": False},
        "health": {"healthProbeBindAddress": f"{HOST}:{ports.kueue_health}"},  # /readyz, /healthz
        "metrics": {"bindAddress": f"{HOST}:{ports.kueue_metrics}"},
        "webhook": {"host": HOST, "port": ports.kueue_webhook, "certDir": str(cert_dir)},
        "internalCertManagement": {"enable": False},
        # waitForPodsReady: absent, so off (v1beta2 has no enable field: its presence turns it on).
        "integrations": {"frameworks": list(KUEUE_FRAMEWORKS)},
        "featureGates": KUEUE_FEATURE_GATES,
    }


def kueue_webhook_configurations(mod: Path, ports: Ports, ca_bundle: str) -> list[dict[str, object]]:
    """Kueue's two webhook configurations from its manifests.yaml, each webhook calling
    https://127.0.0.1:<port><path> instead of the in-cluster Service. Only the webhooks for Kueue's own
    kinds and for KUEUE_FRAMEWORKS are kept: the rest (pods, Deployments, StatefulSets, other operators'
    jobs) would send every such write in the cluster through Kueue for integrations that are off."""
    served = {("kueue.x-k8s.io", "*")} | {
        (group, kind + "s") for group, kind in (f.split("/", 1) for f in KUEUE_FRAMEWORKS)
    }

    def wanted(hook: dict[str, object]) -> bool:
        rules = hook.get("rules", [])
        assert isinstance(rules, list)
        pairs = [
            (g, r) for rule in rules for g in rule.get("apiGroups", []) for r in rule.get("resources", [])
        ]
        return bool(pairs) and all((g, r) in served or (g, "*") in served for g, r in pairs)

    out = []
    for obj in _manifests_json(mod / "config" / "components" / "webhook" / "manifests.yaml"):
        kind = str(obj.get("kind"))
        if kind not in KUEUE_WEBHOOK_CONFIGS:
            continue
        hooks = obj.get("webhooks", [])
        assert isinstance(hooks, list)
        kept = []
        for hook in hooks:
            if not wanted(hook):
                continue
            path = hook["clientConfig"]["service"]["path"]
            hook["clientConfig"] = {
                "url": f"https://{HOST}:{ports.kueue_webhook}{path}",
                "caBundle": ca_bundle,
            }
            kept.append(hook)
        out.append(
            {
                "apiVersion": obj["apiVersion"],
                "kind": kind,
                "metadata": {
                    "name": KUEUE_WEBHOOK_CONFIGS[kind],
                    "labels": {"app.kubernetes.io/name": "kueue"},
                },
                "webhooks": kept,
            }
        )
    return out


def _wait_kueue_admits(timeout: float = 60) -> None:
    """Kueue is ready when a ResourceFlavor passes its webhooks (a server-side dry run: nothing is kept)."""
    probe_flavor = {
        "apiVersion": "kueue.x-k8s.io/v1beta2",
        "kind": "ResourceFlavor",
        "metadata": {"name": "kueue-up-probe"},
    }
    deadline = time.monotonic() + timeout
    while True:
        proc = kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(probe_flavor), check=False)
        if proc.returncode == 0:
            return
        if time.monotonic() > deadline:
            raise ClusterError(
                f"Kueue's webhook did not admit a ResourceFlavor in {timeout:.0f}s:\n{proc.stderr}\n"
                + log_tail("kueue")
            )
        time.sleep(0.5)


def kueue_up(build_binary: bool = False) -> bool:
    """Start Kueue against the running control plane (CRDs, namespace, certificate, Configuration,
    process, webhooks) and wait until its webhooks admit; False if one was running already (reused).
    Without `build_binary` a Kueue that is not built is an error that says how to build it."""
    t0 = time.monotonic()
    state = read_state()
    status = running_status()
    core = {n: alive for n, alive in status.items() if n not in OPTIONAL_COMPONENTS}
    if not state or not core or not all(core.values()):
        raise ClusterError(
            "the control plane is not running: start it with `python3 devcluster/devcluster.py up` "
            "(make cluster-up), then kueue-up"
        )
    pids = state["pids"]
    assert isinstance(pids, dict)
    ports = _cluster_ports(state)
    kdir = STATE / "kueue"
    if status.get("kueue") and probe(f"http://{HOST}:{ports.kueue_health}/readyz"):
        print(f"kueue already running (pid {pids['kueue']}); log: {STATE / 'logs' / 'kueue.log'}")
        return False
    if "kueue" in pids:  # dead, or not ready: start it afresh
        kueue_down(quiet=True)
        pids.pop("kueue", None)
    binary = build(names=["kueue"])["kueue"] if build_binary else built_binary("kueue")
    if binary is None:
        raise ClusterError(
            "Kueue is not built: build it with `python3 devcluster/devcluster.py build kueue` "
            "(`build test` builds it with the other test binaries; see docs/development.md for the cold "
            "build time), or let `python3 devcluster/devcluster.py kueue-up` build it"
        )
    for port in (ports.kueue_webhook, ports.kueue_health, ports.kueue_metrics):
        check_port_free(port, "kueue")
    mod = kueue_module_dir()
    ca_bundle = _kueue_pki(kdir)
    _install_kueue_crds(mod, ca_bundle, ports)
    namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": KUEUE_NAMESPACE}}
    kubectl("apply", "-f", "-", input=json.dumps(namespace))
    config = kdir / "config.yaml"  # JSON, which Kueue's YAML loader reads
    config.write_text(json.dumps(kueue_config(ports, kdir / "certs"), indent=2) + "\n")
    comp = _kueue_component(binary, config, ports)
    (STATE / "logs").mkdir(parents=True, exist_ok=True)
    pids["kueue"] = start(comp)
    _save_state(state)
    try:
        wait_healthy(comp, int(pids["kueue"]), None, timeout=120)
        hooks = kueue_webhook_configurations(mod, ports, ca_bundle)
        hook_list = {"apiVersion": "v1", "kind": "List", "items": hooks}
        kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=json.dumps(hook_list))
        _wait_kueue_admits()
    except BaseException:
        kueue_down(quiet=True)
        raise
    print(
        f"[kueue-up] Kueue {_go_mod_version('kueue', KUEUE_MODULE)} ready in {time.monotonic() - t0:.1f}s "
        f"(pid {pids['kueue']}, webhook https://{HOST}:{ports.kueue_webhook}); "
        f"log: {STATE / 'logs' / 'kueue.log'}",
        flush=True,
    )
    return True


def kueue_down(quiet: bool = False) -> None:
    """Remove Kueue's webhook configurations (so nothing is sent to an absent webhook) and stop it. Its
    CRDs and objects stay; the CRDs' v1beta1<->v1beta2 conversion needs Kueue running again."""
    state = read_state()
    if not state:
        if not quiet:
            print("[kueue-down] the control plane is not running")
        return
    pids = state["pids"]
    assert isinstance(pids, dict)
    if _pid_alive(int(pids.get("kube-apiserver", 0) or 0)):
        kubectl(
            "delete", "--ignore-not-found", "--wait=false",
            *(f"{kind.lower()}/{name}" for kind, name in KUEUE_WEBHOOK_CONFIGS.items()), check=False,
        )  # fmt: skip
    pid = pids.pop("kueue", None)
    if pid is not None:
        _stop(int(pid))
    _save_state(state)
    if not quiet:
        print("[kueue-down] Kueue stopped" if pid is not None else "[kueue-down] Kueue was not running")


@contextlib.contextmanager
def _timed(label: str) -> Iterator[None]:
    t0 = time.monotonic()
    yield
    print(f"[{label}] {time.monotonic() - t0:.1f}s", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "command", choices=["build", "up", "down", "status", "env", "restart", "kueue-up", "kueue-down"]
    )
    parser.add_argument(
        "names",
        nargs="*",
        help="build: binaries or groups to build (up, test; default all); restart: the component",
    )
    parser.add_argument(
        "--plan", action="store_true", help="build: only say what would be compiled and its cold estimate"
    )
    args = parser.parse_intermixed_args(argv)
    try:
        if args.command == "build" and args.plan:
            todo = plan(binary_names(args.names))
            parts = (
                ", ".join(f"{name} ~{seconds}s" for name, seconds in todo.items()) or "nothing: all cached"
            )
            print(f"[build] plan: {parts}")
            print(f"build-plan-seconds: {sum(todo.values())}")
        elif args.command == "build":
            with _timed("build"):
                build(names=binary_names(args.names))
        elif args.command == "up":
            up()
        elif args.command == "down":
            down()
        elif args.command == "kueue-up":
            kueue_up(build_binary=True)
        elif args.command == "kueue-down":
            kueue_down()
        elif args.command == "status":
            return status()
        elif args.command == "restart":
            component = args.names[0] if args.names else ""
            print(f"{component} healthy again after {restart(component):.1f}s")
        elif args.command == "env":
            print(f"export KUBECONFIG={STATE / 'kubeconfig'}\nexport PATH={STATE / 'bin'}:$PATH")
    except ClusterError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
