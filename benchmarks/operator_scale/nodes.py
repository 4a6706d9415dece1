"""The KWOK GPU nodes the jobs run on: their shapes (a few huge nodes, or real 8-GPU machines with
--nodes), how many the jobs need, and creating them Ready and schedulable.
"""

from __future__ import annotations

import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, cast

from lib import common

import devcluster
from operator_scale.measures import progress

GPU = "nvidia.com/gpu"
NOT_READY_TAINT = "node.kubernetes.io/not-ready"
BENCH_LABEL = ("rlhf.dev/bench", "operator-scale")
NODE_BASE = 100  # bench nodes are kwok-gpu-100, -101, ... (the control plane's own are kwok-gpu-0 and -1)


@dataclass(frozen=True)
class NodeShape:
    """A fake node's capacity and allocatable (what the scheduler fits pods into)."""

    label: str
    capacity: dict[str, str]
    allocatable: dict[str, str]

    @property
    def gpus(self) -> int:
        return int(self.allocatable[GPU])

    @property
    def pods(self) -> int:
        return int(self.allocatable["pods"])


# Without --nodes: a few huge nodes (two unless the jobs need more), as this benchmark always had.
_BIG = {"cpu": "2000", "memory": "16Ti", "pods": "400", GPU: "400"}
BIG_NODE = NodeShape("big (400 GPUs, 400 pods)", _BIG, _BIG)

# With --nodes: a real 8-GPU machine (an AWS p4d.24xlarge: 96 vCPUs, 1152 GiB, 8 A100s), with the
# allocatable a kubelet leaves after its system reservations, and the kubelet's default 110 pods.
GPU_NODE = NodeShape(
    "8 GPUs, 96 CPUs, 1152 GiB, 110 pods",
    {"cpu": "96", "memory": "1152Gi", "ephemeral-storage": "7600Gi", "pods": "110", GPU: "8"},
    {"cpu": "95690m", "memory": "1120Gi", "ephemeral-storage": "7000Gi", "pods": "110", GPU: "8"},
)


def job_pod_gpus(template: dict[str, Any]) -> list[int]:
    """The GPUs of each pod of one job's RayCluster (head included), as the operator builds it."""
    from rlhf_api.spec import RLHFJob
    from rlhf_operator.manifests import build_raycluster

    spec = build_raycluster(RLHFJob.model_validate(template))["spec"]
    out: list[int] = []
    for group in [{**spec["headGroupSpec"], "replicas": 1}, *spec["workerGroupSpecs"]]:
        containers = group["template"]["spec"]["containers"]
        gpus = sum(int(c.get("resources", {}).get("requests", {}).get(GPU, 0)) for c in containers)
        out += [gpus] * max(int(group.get("replicas", 1)), int(group.get("maxReplicas", 0)))
    return out


def fits_any_order(n: int, shape: NodeShape, pod_gpus: list[int], jobs: int) -> bool:
    """Whether every pod of `jobs` jobs can be scheduled whatever the scheduler's choices: the nodes whose
    pod slots could all be taken left out, the rest hold every GPU even with each one's last
    (largest pod - 1) GPUs stranded."""
    usable = n - jobs * len(pod_gpus) // shape.pods
    return usable > 0 and jobs * sum(pod_gpus) <= usable * (shape.gpus - max(pod_gpus) + 1)


def plan_nodes(nodes: int | None, pod_gpus: list[int], jobs: int) -> tuple[int, NodeShape]:
    """(count, shape) of the bench nodes: `nodes` real 8-GPU ones, or (None) enough big ones, at least 2.
    Raises if the jobs cannot fit; warns if 8-GPU nodes fit them only with a lucky placement."""
    gpus, pods = jobs * sum(pod_gpus), jobs * len(pod_gpus)
    if nodes is None:
        shape = BIG_NODE
        nodes = max(2, math.ceil(gpus / shape.gpus), math.ceil(pods / shape.pods))
    else:
        shape = GPU_NODE
    if gpus > nodes * shape.gpus or pods > nodes * shape.pods or max(pod_gpus) > shape.gpus:
        raise RuntimeError(
            f"{jobs} jobs need {gpus} GPUs and {pods} pods ({pod_gpus} GPUs per pod): more than "
            f"{nodes} nodes of {shape.label} hold"
        )
    if shape is GPU_NODE and not fits_any_order(nodes, shape, pod_gpus, jobs):
        need = next(n for n in range(nodes, 100 * nodes) if fits_any_order(n, shape, pod_gpus, jobs))
        common.console.print(
            f"[yellow]{nodes} nodes fit the jobs only if the scheduler packs GPUs well; {need} always do[/yellow]"
        )
    return nodes, shape


def node_body(i: int, shape: NodeShape) -> dict[str, Any]:
    """A KWOK GPU node as the control plane's own (annotated for KWOK to manage it), of `shape`."""
    node = cast(dict[str, Any], devcluster.node_manifest(NODE_BASE + i))
    node["metadata"]["labels"][BENCH_LABEL[0]] = BENCH_LABEL[1]
    node["status"] = {"capacity": shape.capacity, "allocatable": shape.allocatable}
    return node


def add_nodes(core: Any, n: int, shape: NodeShape, threads: int = 16) -> None:
    """Create `n` KWOK nodes from a thread pool, then wait until each is Ready and without the not-ready
    taint (the TaintNodesByCondition admission plugin gives it to every new node; the node lifecycle
    controller, off here, is what would lift it)."""
    t0 = time.monotonic()
    state = {"created": 0, "schedulable": 0}

    with (
        ThreadPoolExecutor(threads) as pool,
        progress(lambda: f"nodes: {state['created']}/{n} created, {state['schedulable']}/{n} schedulable"),
    ):
        for _ in pool.map(lambda i: core.create_node(node_body(i, shape)), range(n)):
            state["created"] += 1
        untaint_when_ready(core, pool, n, state, timeout=120 + n / 2)
    common.console.print(
        f"[dim]{n} nodes ({shape.label}) Ready and schedulable in {time.monotonic() - t0:.0f}s[/dim]"
    )


def untaint_when_ready(
    core: Any, pool: ThreadPoolExecutor, n: int, state: dict[str, int], timeout: float
) -> None:
    """Remove the not-ready taint from each bench node once KWOK has marked it Ready, until all are done."""
    done: set[str] = set()
    deadline = time.monotonic() + timeout
    selector = f"{BENCH_LABEL[0]}={BENCH_LABEL[1]}"
    while len(done) < n:
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {len(done)} of {n} nodes Ready and schedulable in {timeout:.0f}s")
        ready = [nd for nd in core.list_node(label_selector=selector).items if node_ready(nd)]
        todo = [nd for nd in ready if nd.metadata.name not in done]
        list(pool.map(lambda nd: untaint(core, nd), todo))
        done.update(nd.metadata.name for nd in todo)
        state["schedulable"] = len(done)
        if len(done) < n:
            time.sleep(2.0)


def node_ready(node: Any) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in node.status.conditions or [])


def untaint(core: Any, node: Any) -> None:
    taints = node.spec.taints or []
    keep = [t for t in taints if t.key != NOT_READY_TAINT]
    if len(keep) < len(taints):
        value = core.api_client.sanitize_for_serialization(keep)
        core.patch_node(node.metadata.name, [{"op": "replace", "path": "/spec/taints", "value": value}])
