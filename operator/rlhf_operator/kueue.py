"""Kueue's side of a job, read and never written: whether Kueue manages the job's RayCluster, whether it
manages it as an elastic workload, and why a queued one waits (docs/kueue.md).

The model: Kueue manages the RayCluster the operator creates (Kueue's own RayCluster integration). The
job's `kueue.x-k8s.io/queue-name` label goes onto the RayCluster; Kueue suspends it at creation, admits
it by setting `spec.suspend: false` and evicts it by setting it back. The operator never writes that
field of such a cluster, nor any Workload: it reads them. Pure: no I/O.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from rlhf_operator.conditions import set_condition

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
# Kueue's label on a Workload naming the UID of the object it queues.
JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"
# Asks Kueue to manage a RayCluster as an elastic workload (workload slices): its worker replicas may
# change while admitted. Kueue honours it only with its ElasticJobsViaWorkloadSlices feature gate on, and
# then its webhook puts ELASTIC_GATE on the pod templates: the gate on the cluster is the proof.
ELASTIC_ANNOTATION = "kueue.x-k8s.io/elastic-job"
ELASTIC_GATE = "kueue.x-k8s.io/elastic-job"
WORKLOAD_GROUP, WORKLOAD_PLURAL = "kueue.x-k8s.io", "workloads"
WORKLOAD_VERSIONS = ("v1beta2", "v1beta1")  # newest first: v1beta2 from Kueue 0.15


def queue_name(job_labels: dict[str, Any] | None, raycluster: dict[str, Any] | None) -> str | None:
    """The LocalQueue the job's RayCluster is queued in: its own label (Kueue may default it), else the
    job's (before the cluster exists)."""
    labels = ((raycluster or {}).get("metadata") or {}).get("labels") or {}
    name = labels.get(QUEUE_LABEL) or (job_labels or {}).get(QUEUE_LABEL)
    return str(name) if name else None


def elastic(raycluster: dict[str, Any] | None) -> bool:
    """Whether Kueue took the RayCluster as an elastic workload (its webhook gated the head's pods)."""
    head = ((raycluster or {}).get("spec") or {}).get("headGroupSpec") or {}
    gates = ((head.get("template") or {}).get("spec") or {}).get("schedulingGates") or []
    return any(g.get("name") == ELASTIC_GATE for g in gates)


def suspended_by_kueue(raycluster: dict[str, Any] | None, managed: bool) -> bool:
    return managed and bool(((raycluster or {}).get("spec") or {}).get("suspend"))


def holds_replicas(raycluster: dict[str, Any]) -> bool:
    """Whether the operator must leave the replicas of a Kueue-managed RayCluster as they are: while it
    is queued (a change would make Kueue re-create its Workload), and while admitted unless Kueue took it
    as an elastic workload (a change would not match the admitted Workload, and Kueue would evict it)."""
    return suspended_by_kueue(raycluster, True) or not elastic(raycluster)


def fixed_size_condition(
    conditions: list[dict[str, Any]], engines: Any, now: datetime
) -> tuple[list[dict[str, Any]], str | None]:
    """The EngineScaling condition of an admitted fixed-size workload, and its message if it is new (for
    the one Event that says so)."""
    message = (
        f"Kueue manages this RayCluster as a fixed-size workload: the rollout engines stay at {engines} "
        "(engine autoscaling and kubectl scale are off until it is readmitted; Kueue's "
        "ElasticJobsViaWorkloadSlices feature gate makes it elastic, docs/kueue.md)"
    )
    new = not any(
        c.get("type") == "EngineScaling" and c.get("reason") == "KueueNotElastic" for c in conditions
    )
    conds = set_condition(conditions, "EngineScaling", False, "KueueNotElastic", message, now)
    return conds, message if new else None


def _condition(workload: dict[str, Any], kind: str) -> dict[str, Any] | None:
    return next(
        (c for c in (workload.get("status") or {}).get("conditions") or [] if c.get("type") == kind), None
    )


def why_waiting(workload: dict[str, Any] | None, queue: str) -> tuple[str, str]:
    """(reason, message) for a RayCluster Kueue holds suspended, in Kueue's own words.

    An eviction (preemption, a deactivation) is the first reason: after it the quota condition says only
    that the workload is pending again. No Workload yet: Kueue has not picked the cluster up.
    """
    if workload is None:
        return "WorkloadPending", f"waiting for Kueue to create a Workload in LocalQueue {queue}"
    evicted = _condition(workload, "Evicted")
    if evicted is not None and evicted.get("status") == "True":
        return str(evicted.get("reason") or "Evicted"), str(evicted.get("message") or "evicted by Kueue")
    quota = _condition(workload, "QuotaReserved")
    if quota is not None and quota.get("status") == "False":
        return str(quota.get("reason") or "Pending"), str(quota.get("message") or "no quota reserved")
    admitted = _condition(workload, "Admitted")
    if admitted is not None and admitted.get("status") == "True":
        return "Admitted", "admitted by Kueue; waiting for it to unsuspend the RayCluster"
    return "Pending", f"waiting for Kueue to admit the Workload in LocalQueue {queue}"


def slim_workload(workload: dict[str, Any]) -> dict[str, Any]:
    """A Workload with only what the status reads: its name and conditions."""
    meta = workload.get("metadata") or {}
    conds = (workload.get("status") or {}).get("conditions") or []
    keep = ("type", "status", "reason", "message")
    return {
        "metadata": {"name": meta.get("name")},
        "status": {"conditions": [{k: c[k] for k in keep if k in c} for c in conds]},
    }
