"""The loopback ports of every component (RLHF_CLUSTER_PORT_OFFSET moves them all), and the check that
one is free before anything is started on it.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from devcluster.config import HOST, ClusterError


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
