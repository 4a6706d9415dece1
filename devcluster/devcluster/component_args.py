"""The processes of the control plane and of the real node, with their flags, in start order. What
each runs with is said here only; starting and stopping them is controlplane.py's.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path

import node

from devcluster.config import HOST, STATE
from devcluster.kwok import write_kwok_stages
from devcluster.ports import Ports
from devcluster.processes import Component


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
