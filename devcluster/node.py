"""The real node: a kubelet over Debian's containerd and runc, kube-proxy, CoreDNS, and a pod network
on a bridge of our own that routes nowhere beyond this machine.

Owns the node's network (bridge, CNI configuration, isolation rules), its configuration files, its
processes' command lines and its teardown. devcluster.py starts and stops it with the control plane;
images/build_images.py owns containerd and the images. Standard library only.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

NODE_NAME = "rlhf-node-0"
BRIDGE = "rlhf0"
POD_SUBNET = "10.244.0.0/24"
GATEWAY = "10.244.0.1"  # the bridge's address: the node's IP, and where pods reach the API server and DNS
SERVICE_CIDR = "10.96.0.0/16"
DNS_SERVICE_IP = "10.96.0.10"
CLUSTER_DOMAIN = "cluster.local"
# e2e pods select the real node by this label and tolerate its taint; nothing else lands there.
NODE_LABEL = ("rlhf.dev/node", "real")
NODE_TAINT = "rlhf.dev/real-node"
ISOLATION_CHAIN = "RLHF-NODE-ISOLATION"
# The one stand-in left on the real node: GPUs (advertised, not present; ranks run on the CPU).
GPU_RESOURCE = "nvidia.com/gpu"
STAND_IN_GPUS = 8
IMAGES_DIR = Path(__file__).resolve().parents[1] / "images"


class NodeError(RuntimeError):
    """The real node cannot start here; the message names what is missing."""


@dataclass(frozen=True)
class NodePaths:
    """Everything the node writes lives under one directory of the cluster's state."""

    root: Path

    @property
    def kubelet_root(self) -> Path:
        return self.root / "kubelet"

    @property
    def kubelet_config(self) -> Path:
        return self.root / "kubelet-config.json"

    @property
    def kube_proxy_config(self) -> Path:
        return self.root / "kube-proxy-config.json"

    @property
    def corefile(self) -> Path:
        return self.root / "Corefile"

    @property
    def resolv_conf(self) -> Path:
        return self.root / "resolv.conf"

    @property
    def ipam_dir(self) -> Path:
        return self.root / "cni-ipam"


def enabled() -> bool:
    """The real node is on unless RLHF_REAL_NODE=0 (for when start-up speed matters more)."""
    return os.environ.get("RLHF_REAL_NODE", "1") not in ("0", "false", "no")


# ---------------------------------------------------------------------------------------------- configs


def cni_conflist(paths: NodePaths) -> dict[str, object]:
    """A bridge with host-local addresses. Pods get a route to the pod subnet and the Service range
    through the bridge, and no default route: nothing beyond this machine is reachable from a pod."""
    return {
        "cniVersion": "1.0.0",
        "name": "rlhf-pods",
        "plugins": [
            {
                "type": "bridge",
                "bridge": BRIDGE,
                "isGateway": True,
                "ipMasq": False,
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "dataDir": str(paths.ipam_dir),
                    "ranges": [[{"subnet": POD_SUBNET, "gateway": GATEWAY}]],
                    "routes": [{"dst": SERVICE_CIDR}],
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }


def kubelet_config(
    paths: NodePaths, ca: Path, socket: Path, port: int, healthz_port: int
) -> dict[str, object]:
    """Only the API server (a client certificate of our CA) may call the kubelet; it serves on the
    node's bridge address. Image garbage collection is off: the images are built here and cannot be
    pulled again."""
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "address": GATEWAY,
        "port": port,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": healthz_port,
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": False},
            "x509": {"clientCAFile": str(ca)},
        },
        "authorization": {"mode": "AlwaysAllow"},
        "cgroupDriver": "cgroupfs",
        "failCgroupV1": False,  # this machine has cgroup v1 (hybrid); kubelet >= 1.35 refuses it otherwise
        "containerRuntimeEndpoint": f"unix://{socket}",
        "clusterDNS": [DNS_SERVICE_IP],
        "clusterDomain": CLUSTER_DOMAIN,
        "resolvConf": str(paths.resolv_conf),
        "failSwapOn": False,
        "registerWithTaints": [{"key": NODE_TAINT, "value": "true", "effect": "NoSchedule"}],
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "evictionHard": {
            "memory.available": "200Mi",
            "nodefs.available": "1%",
            "imagefs.available": "1%",
            "nodefs.inodesFree": "1%",
        },
        "serializeImagePulls": False,
        "maxPods": 40,
        "nodeStatusReportFrequency": "10s",
        "shutdownGracePeriod": "0s",
        "rotateCertificates": False,
        "serverTLSBootstrap": False,
    }


def kube_proxy_config(kubeconfig: Path, metrics_port: int, healthz_port: int) -> dict[str, object]:
    """iptables mode. Service traffic is masqueraded to the bridge address, so replies come back through
    the host's connection tracking even between pods on the same bridge. Conntrack sysctls are left
    as the machine has them."""
    return {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "clientConnection": {"kubeconfig": str(kubeconfig)},
        "hostnameOverride": NODE_NAME,
        "mode": "iptables",
        "clusterCIDR": POD_SUBNET,
        "bindAddress": "127.0.0.1",
        "metricsBindAddress": f"127.0.0.1:{metrics_port}",
        "healthzBindAddress": f"127.0.0.1:{healthz_port}",
        "iptables": {"masqueradeAll": True, "syncPeriod": "30s", "minSyncPeriod": "1s"},
        "conntrack": {
            "maxPerCore": 0,
            "min": 0,
            "tcpEstablishedTimeout": "0s",
            "tcpCloseWaitTimeout": "0s",
        },
        "nodePortAddresses": [f"{GATEWAY}/32"],
    }


def corefile(kubeconfig: Path, health_port: int, ready_port: int) -> str:
    """Cluster DNS for Services and pods, on the bridge address. Any other name is answered NXDOMAIN at
    once: nothing resolves beyond the machine, and nothing waits on a forwarder."""
    return f""".:53 {{
    bind {GATEWAY}
    errors
    health 127.0.0.1:{health_port}
    ready 127.0.0.1:{ready_port}
    kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{
        kubeconfig {kubeconfig}
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
    }}
    cache 5
    template ANY ANY {{
        rcode NXDOMAIN
    }}
}}
"""


def dns_objects() -> list[dict[str, object]]:
    """The kube-dns Service (no selector: CoreDNS runs on the host) and its EndpointSlice."""
    ports = [
        {"name": "dns", "port": 53, "protocol": "UDP"},
        {"name": "dns-tcp", "port": 53, "protocol": "TCP"},
    ]
    labels = {"k8s-app": "kube-dns", "kubernetes.io/name": "CoreDNS"}
    return [
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "kube-dns", "namespace": "kube-system", "labels": labels},
            "spec": {"clusterIP": DNS_SERVICE_IP, "ports": ports},
        },
        {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {
                "name": "kube-dns-host",
                "namespace": "kube-system",
                "labels": {
                    "kubernetes.io/service-name": "kube-dns",
                    "endpointslice.kubernetes.io/managed-by": "devcluster.rlhf.dev",
                },
            },
            "addressType": "IPv4",
            "endpoints": [{"addresses": [GATEWAY], "conditions": {"ready": True}}],
            "ports": ports,
        },
    ]


# ---------------------------------------------------------------------------------------------- host


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=120)
    if check and proc.returncode != 0:
        raise NodeError(f"`{' '.join(cmd)}` failed: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def missing_prerequisites() -> list[str]:
    """What this machine lacks to run the real node, each named so the user can act."""
    problems = []
    if os.geteuid() != 0:
        problems.append("root (the kubelet, containerd and the bridge network run as root)")
    for tool, package in (
        ("ip", "iproute2"),
        ("iptables", "iptables"),
        ("containerd", "containerd"),
        ("runc", "runc"),
        ("mount", "mount"),
    ):
        if not shutil.which(tool):
            problems.append(f"`{tool}` (Debian package {package})")
    for plugin in ("bridge", "host-local", "loopback", "portmap"):
        if not Path("/usr/lib/cni", plugin).exists():
            problems.append(
                f"the CNI plugin /usr/lib/cni/{plugin} (Debian package containernetworking-plugins)"
            )
    if not Path("/proc/sys/net/bridge/bridge-nf-call-iptables").exists():
        problems.append("the kernel's br_netfilter (modprobe br_netfilter)")
    return problems


def install_packages() -> None:
    """Debian's containerd, runc, CNI plugins and iptables, when missing and we are root."""
    wanted = {
        "iptables": "iptables",
        "containerd": "containerd",
        "runc": "runc",
        "ip": "iproute2",
    }
    packages = sorted({pkg for tool, pkg in wanted.items() if not shutil.which(tool)})
    if not Path("/usr/lib/cni/bridge").exists():
        packages.append("containernetworking-plugins")
    if not packages or os.geteuid() != 0:
        return
    print(f"[node] apt-get install {' '.join(packages)}", flush=True)
    sys.path.insert(0, str(IMAGES_DIR))
    import build_images

    try:
        build_images.apt_install(packages)
    except build_images.Missing as e:
        raise NodeError(str(e)) from None


def setup_network(paths: NodePaths, cni_conf_dir: Path) -> None:
    """The bridge with the node's address, forwarding only between the bridge's own ports and the
    host, and the CNI configuration containerd reads."""
    if _run("ip", "link", "show", BRIDGE, check=False).returncode != 0:
        _run("ip", "link", "add", BRIDGE, "type", "bridge")
    addrs = _run("ip", "-o", "-4", "addr", "show", "dev", BRIDGE).stdout
    if f"{GATEWAY}/" not in addrs:
        _run("ip", "addr", "add", f"{GATEWAY}/24", "dev", BRIDGE)
    _run("ip", "link", "set", BRIDGE, "up")
    # Service traffic between pods on one bridge must pass the host's iptables (kube-proxy's DNAT).
    Path("/proc/sys/net/bridge/bridge-nf-call-iptables").write_text("1\n")
    Path("/proc/sys/net/ipv4/ip_forward").write_text("1\n")
    # Forwarding is on for the bridge only: nothing enters or leaves it through another interface.
    if _run("iptables", "-w", "-nL", ISOLATION_CHAIN, check=False).returncode != 0:
        _run("iptables", "-w", "-N", ISOLATION_CHAIN)
    _run("iptables", "-w", "-F", ISOLATION_CHAIN)
    _run("iptables", "-w", "-A", ISOLATION_CHAIN, "-i", BRIDGE, "!", "-o", BRIDGE, "-j", "DROP")
    _run("iptables", "-w", "-A", ISOLATION_CHAIN, "!", "-i", BRIDGE, "-o", BRIDGE, "-j", "DROP")
    if _run("iptables", "-w", "-C", "FORWARD", "-j", ISOLATION_CHAIN, check=False).returncode != 0:
        _run("iptables", "-w", "-I", "FORWARD", "1", "-j", ISOLATION_CHAIN)
    paths.ipam_dir.mkdir(parents=True, exist_ok=True)
    cni_conf_dir.mkdir(parents=True, exist_ok=True)
    for old in cni_conf_dir.glob("*.conflist"):
        old.unlink()
    (cni_conf_dir / "10-rlhf-pods.conflist").write_text(json.dumps(cni_conflist(paths), indent=2))


def teardown_network() -> None:
    with contextlib.suppress(NodeError):
        _run("iptables", "-w", "-D", "FORWARD", "-j", ISOLATION_CHAIN, check=False)
        _run("iptables", "-w", "-F", ISOLATION_CHAIN, check=False)
        _run("iptables", "-w", "-X", ISOLATION_CHAIN, check=False)
        _run("ip", "link", "del", BRIDGE, check=False)


def write_configs(paths: NodePaths, ca: Path, kubeconfig: Path, socket: Path, ports: dict[str, int]) -> None:
    paths.root.mkdir(parents=True, exist_ok=True)
    paths.kubelet_root.mkdir(parents=True, exist_ok=True)
    # Pods with dnsPolicy Default get this file; ClusterFirst pods get the cluster DNS. No upstream.
    paths.resolv_conf.write_text(f"nameserver {GATEWAY}\n")
    paths.kubelet_config.write_text(
        json.dumps(kubelet_config(paths, ca, socket, ports["kubelet"], ports["kubelet_healthz"]), indent=2)
    )
    paths.kube_proxy_config.write_text(
        json.dumps(
            kube_proxy_config(kubeconfig, ports["kube_proxy_metrics"], ports["kube_proxy_healthz"]), indent=2
        )
    )
    paths.corefile.write_text(corefile(kubeconfig, ports["coredns_health"], ports["coredns_ready"]))


def runtime_up() -> tuple[int, Path, Path]:
    """Starts (or finds) our containerd with the pause image loaded; returns (pid, socket, CNI conf dir)."""
    proc = subprocess.run(
        [sys.executable, str(IMAGES_DIR / "build_images.py"), "runtime-up"],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if proc.returncode != 0:
        raise NodeError(
            f"the node's container runtime did not start:\n{proc.stderr.strip()}\n{proc.stdout[-1500:]}"
        )
    sys.path.insert(0, str(IMAGES_DIR))
    import build_images
    import containerd_runtime

    rt = containerd_runtime.Runtime(build_images.runtime_home())
    pid = containerd_runtime.running_pid(rt)
    if pid is None:
        raise NodeError(f"containerd reported started but does not answer on {rt.socket}")
    return pid, rt.socket, rt.cni_conf_dir


def runtime_down() -> None:
    subprocess.run(
        [sys.executable, str(IMAGES_DIR / "build_images.py"), "runtime-down"],
        capture_output=True,
        text=True,
        timeout=120,
    )


def kill_containers(socket: Path) -> int:
    """Kills every task our containerd still runs (what the kubelet left behind); returns how many."""
    ids = running_tasks(socket)
    for cid in ids:
        subprocess.run(
            ["ctr", "--address", str(socket), "--namespace", "k8s.io", "tasks", "kill", "-s", "SIGKILL", cid],
            capture_output=True,
            timeout=30,
        )
    deadline = time.monotonic() + 20
    while ids and running_tasks(socket) and time.monotonic() < deadline:
        time.sleep(0.5)
    return len(ids)


def unmount_under(root: Path) -> None:
    """Unmounts what the kubelet mounted under its root (emptyDirs, projected tokens), deepest first."""
    prefix = str(root.resolve())
    mounts = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mounts").read_text().splitlines():
            target = line.split()[1].replace("\\040", " ")
            if target == prefix or target.startswith(prefix + "/"):
                mounts.append(target)
    for target in sorted(mounts, key=len, reverse=True):
        subprocess.run(["umount", "-l", target], capture_output=True, timeout=30)


def runtime_socket() -> Path:
    sys.path.insert(0, str(IMAGES_DIR))
    import build_images
    import containerd_runtime

    return containerd_runtime.Runtime(build_images.runtime_home()).socket


def running_tasks(socket: Path) -> list[str]:
    if not socket.exists():
        return []
    proc = subprocess.run(
        ["ctr", "--address", str(socket), "--namespace", "k8s.io", "tasks", "ls", "-q"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return [line.strip() for line in proc.stdout.splitlines() if line.strip()]


def other_node(kubelet_root: Path) -> str | None:
    """The root directory of another cluster's real node running on this machine, if any: the bridge,
    containerd and node name are one per machine (a test cluster and the demo's cannot both have one)."""
    ours = f"--root-dir={kubelet_root}"
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if (
            argv
            and argv[0].endswith("kubelet")
            and f"--hostname-override={NODE_NAME}" in argv
            and ours not in argv
        ):
            return next((a.split("=", 1)[1] for a in argv if a.startswith("--root-dir=")), "?")
    return None
