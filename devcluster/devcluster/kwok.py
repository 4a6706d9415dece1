"""The fake GPU nodes: KWOK's stages (what a kubelet would write for them) and the nodes
kwok-gpu-<i>, registered Ready and schedulable.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from devcluster.config import STATE, ClusterError
from devcluster.kube import kubectl

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


def register_default_nodes() -> None:
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
