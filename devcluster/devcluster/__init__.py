"""The local control plane: real etcd, kube-apiserver, controller-manager, scheduler, KWOK and KubeRay,
built from the Go module proxy and run as background processes on loopback. Standard library only, so
it runs before the project's virtualenv exists; `python3 devcluster/devcluster.py` is its command line.

The modules, each importing only those above it:
    config         where things are (state directory, Go wrapper modules, cache) and ClusterError
    binaries       the Go commands and their link flags (what a build key is made of)
    gobuild        `go build` into the cache, keyed; links into the state directory's bin/
    pki, ports     credentials and kubeconfig; every component's loopback port
    processes      start, probe, wait for and stop one background process
    kube, kwok     kubectl and the Go module cache's manifests; KWOK's stages and fake GPU nodes
    state          state.json: the running cluster's processes, token and ports
    component_args every component's command line, in start order
    real_node      the control plane's side of the real node (node.py, beside this package, is the node)
    kueue          Kueue on demand (kueue-up, kueue-down)
    controlplane   up, restart, down, status
    cli            the command line

`import devcluster` (tests, benchmarks: devcluster/ is on their path) gets the names below.
"""

from __future__ import annotations

from devcluster.binaries import (
    BINARIES,
    CONTROL_PLANE_BINARIES,
    KUEUE_MODULE,
    NODE_BINARIES,
    OPTIONAL_COMPONENTS,
    TEST_BINARIES,
    Binary,
    binary_names,
    up_binaries,
)
from devcluster.cli import main
from devcluster.component_args import components, node_components
from devcluster.config import CACHE, GO_DIR, HOST, KUBERNETES_VERSION, ROOT, STATE, TOKEN_USER, ClusterError
from devcluster.controlplane import down, restart, status, up
from devcluster.gobuild import binary_path, build, built_binary
from devcluster.kube import kubectl, kuberay_crd_dir, module_dir
from devcluster.kueue import (
    KUEUE_FEATURE_GATES,
    KUEUE_FRAMEWORKS,
    KUEUE_METRICS_CERT_DIR,
    KUEUE_NAMESPACE,
    KUEUE_WEBHOOK_CONFIGS,
    kueue_config,
    kueue_down,
    kueue_module_dir,
    kueue_up,
    kueue_webhook_configurations,
)
from devcluster.kwok import KWOK_STAGES, NODES, node_manifest, register_nodes, write_kwok_stages
from devcluster.pki import make_pki, write_kubeconfig
from devcluster.ports import Ports, check_port_free
from devcluster.processes import Component, log_tail, probe, start, wait_healthy
from devcluster.state import read_state, running_status

__all__ = [
    "BINARIES",
    "CACHE",
    "CONTROL_PLANE_BINARIES",
    "GO_DIR",
    "HOST",
    "KUBERNETES_VERSION",
    "KUEUE_FEATURE_GATES",
    "KUEUE_FRAMEWORKS",
    "KUEUE_METRICS_CERT_DIR",
    "KUEUE_MODULE",
    "KUEUE_NAMESPACE",
    "KUEUE_WEBHOOK_CONFIGS",
    "KWOK_STAGES",
    "NODES",
    "NODE_BINARIES",
    "OPTIONAL_COMPONENTS",
    "ROOT",
    "STATE",
    "TEST_BINARIES",
    "TOKEN_USER",
    "Binary",
    "ClusterError",
    "Component",
    "Ports",
    "binary_names",
    "binary_path",
    "build",
    "built_binary",
    "check_port_free",
    "components",
    "down",
    "kubectl",
    "kuberay_crd_dir",
    "kueue_config",
    "kueue_down",
    "kueue_module_dir",
    "kueue_up",
    "kueue_webhook_configurations",
    "log_tail",
    "main",
    "make_pki",
    "module_dir",
    "node_components",
    "node_manifest",
    "probe",
    "read_state",
    "register_nodes",
    "restart",
    "running_status",
    "start",
    "status",
    "up",
    "up_binaries",
    "wait_healthy",
    "write_kubeconfig",
    "write_kwok_stages",
]
