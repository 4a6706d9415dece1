"""Whether a job that asked for an RDMA fabric got one: the `FabricDegraded` condition. Pure.

The trainer exports the network NCCL chose for each rank (`rlhf_nccl_transport{process,network}`,
GPU path only: rlhf_trainer.stacks.nccl). A job asked for RDMA when the pods that talk NCCL request
an RDMA device resource (`pods`, `pods.fabric` or `pods.trainer` resources: `rdma/...`, an InfiniBand
HCA, AWS EFA). If such a job's ranks run over TCP sockets, the job works, several times slower, and
nothing else says so: the condition does.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Any

from rlhf_api.spec import RLHFJobSpec

from rlhf_operator.conditions import set_condition

CONDITION_TYPE = "FabricDegraded"
_RDMA_RESOURCE = re.compile(r"(^rdma/|/rdma|/hca|infiniband|/ib$|roce|/efa$|mlnx)", re.IGNORECASE)


def asks_rdma(spec: RLHFJobSpec) -> bool:
    """An RDMA device resource among the settings of the pods that talk NCCL."""
    for settings in (spec.pods, spec.pods.fabric, spec.pods.trainer, spec.pods.rollout):
        res = settings.resources if settings is not None else None
        if res is None:
            continue
        names = [*(res.limits or {}), *(res.requests or {})]
        if any(_RDMA_RESOURCE.search(n) for n in names):
            return True
    return False


def fabric_condition(
    conditions: list[dict[str, Any]], asked: bool, networks: dict[str, str], now: datetime
) -> tuple[list[dict[str, Any]], str | None]:
    """`conditions` with FabricDegraded set from the ranks' networks, and the message when it turned
    True this round (for an Event). Nothing for a job that asked for no RDMA or reported no network."""
    if not asked or not networks:
        return conditions, None
    on_sockets = sorted(who for who, net in networks.items() if net.lower() == "socket")
    before = next((c for c in conditions if c.get("type") == CONDITION_TYPE), None)
    if not on_sockets:
        said = ", ".join(sorted({n for n in networks.values()}))
        return set_condition(conditions, CONDITION_TYPE, False, "RDMA", f"NCCL over {said}", now), None
    message = (
        f"{len(on_sockets)} of {len(networks)} NCCL processes run over TCP sockets although the job asks "
        f"for an RDMA device: {', '.join(on_sockets[:8])}; check the RDMA device plugin on their nodes and "
        "pods.fabric (resources, NCCL_IB_HCA, the network annotation)"
    )
    new = set_condition(conditions, CONDITION_TYPE, True, "SocketTransport", message, now)
    turned = before is None or before.get("status") != "True"
    return new, message if turned else None
