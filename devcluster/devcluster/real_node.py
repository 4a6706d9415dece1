"""The control plane's side of the real node (node.py owns the node itself): containerd and the
bridge before the kubelet starts, the node Ready with its GPU stand-in, and its pods drained before
teardown.
"""

from __future__ import annotations

import json
import time

import node

from devcluster.config import STATE, ClusterError
from devcluster.kube import kubectl
from devcluster.ports import Ports
from devcluster.processes import log_tail


def prepare_real_node(ports: Ports) -> int:
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


def wait_real_node_ready(timeout: float = 120) -> None:
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


def drain_real_node(timeout: float = 30) -> None:
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
