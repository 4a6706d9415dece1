"""What the operator sees of the cluster: the RayCluster and pod indexes fed by kopf's watches (slimmed),
the typed job (parsed once per resourceVersion), and read-your-writes over them (expectations.py).

Reads only; writes happen in `children` and the status patch of `handlers`.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any, cast

import kopf
from kubernetes import client as k8s
from pydantic import ValidationError
from rlhf_api import runtime_merge
from rlhf_api.rules import violated
from rlhf_api.spec import RLHFJob

from rlhf_operator import kube, manifests, pod_problems, runtime, runtimes
from rlhf_operator.conditions import parse_time


def parse(body: kopf.Body) -> RLHFJob | str:
    """The typed job, or the validation error text (a bad object must never crash the operator); the last
    parse is reused while the resourceVersion is the same (JobState.parsed)."""
    uid, version = body.metadata.uid or "", str(body.metadata.get("resourceVersion") or "")
    state = runtime.JOBS.peek(uid)
    cached = state.parsed if state is not None else None
    if cached is not None and version and cached[0] == version:
        return cached[1]
    result = _validate(body)
    if uid and version:
        runtime.JOBS.get(uid).parsed = (version, result)
    return result


def _validate(body: kopf.Body) -> RLHFJob | str:
    """The typed job; for a job on a runtime, its spec merged with the runtime it was bound to
    (runtime_merge.merge), checked by the same schema and rules as a job's own spec."""
    spec: dict[str, Any] = dict(body.spec)
    on = ""
    try:
        bound = runtimes.bound(body)
        if bound is not None:
            spec = runtime_merge.merge(
                spec,
                bound.spec,
                bound.ref,
                body.metadata.name or "",
                body.metadata.namespace or "default",
                gpu_standin=bool(runtime.CONFIG.gpu_standin),
            ).spec
            on = f" (merged with {bound.ref} generation {bound.generation})"
    except runtimes.RuntimeUnusable as e:
        return _runtime_problem(body, e.reason, e.message)
    except runtime_merge.MergeError as e:
        return _runtime_problem(body, "FieldNotOverridable", str(e))
    except ValueError as e:  # a runtime layer that does not parse (its model should have refused it)
        return _runtime_problem(body, "RuntimeInvalid", str(e))
    try:
        job = RLHFJob.model_validate(
            {
                "apiVersion": body.get("apiVersion"),
                "kind": body.get("kind"),
                "metadata": dict(body.metadata),
                "spec": spec,
                "status": clean_status(dict(body.status)),
            }
        )
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(x) for x in first["loc"])
        message = f"{loc}: {first['msg']} ({e.error_count()} error(s)){on}"
        return _runtime_problem(body, "MergedSpecInvalid", message) if on else message
    if on:
        broken = violated(job.spec)
        if broken:
            return _runtime_problem(
                body, "MergedSpecInvalid", f"{broken[0].field_path}: {broken[0].message}{on}"
            )
    return job


def _runtime_problem(body: kopf.Body, reason: str, message: str) -> str:
    """Keep why the job's runtime failed it (handlers._invalid writes the condition from it)."""
    runtime.state_of(body).runtime = runtimes.RuntimeUnusable(reason, message)
    return message


def clean_status(status: dict[str, Any]) -> dict[str, Any] | None:
    status.pop("kopf", None)
    return status or None


# RayClusters are read from a kopf index fed by a watch (`rayclusters` below), not by a GET per round.
# The index is handed to handlers as a keyword argument; they keep it here for the helpers they call.
_cluster_index: kopf.Index[tuple[str, str], dict[str, Any]] | None = None


@kopf.index(kube.RAY_GROUP, kube.RAY_VERSION, kube.RAY_PLURAL, labels={manifests.JOB_LABEL: kopf.PRESENT})
def rayclusters(
    namespace: str | None, name: str | None, body: kopf.Body, **_: Any
) -> dict[tuple[str, str], dict[str, Any]]:
    """Every RayCluster of an RLHFJob, by (namespace, name), with only what the operator reads (its pod
    templates are most of a RayCluster, and 1,000 of them whole held hundreds of MiB)."""
    return {(namespace or "default", name or ""): slim_raycluster(body)}


def slim_raycluster(body: kopf.Body | dict[str, Any]) -> dict[str, Any]:
    """Metadata, `spec.suspend`, the worker groups' names and replica counts, and the whole status."""
    meta, spec = body.get("metadata") or {}, body.get("spec") or {}
    keep = ("name", "namespace", "uid", "resourceVersion", "labels", "ownerReferences", "deletionTimestamp")
    groups = [
        {k: g[k] for k in ("groupName", "replicas", "minReplicas", "maxReplicas") if k in g}
        for g in spec.get("workerGroupSpecs") or []
    ]
    slim_spec: dict[str, Any] = {"suspend": spec.get("suspend"), "workerGroupSpecs": groups}
    gates = (((spec.get("headGroupSpec") or {}).get("template") or {}).get("spec") or {}).get(
        "schedulingGates"
    )
    if gates:  # Kueue's elastic-workload gate (kueue.elastic reads it)
        slim_spec["headGroupSpec"] = {"template": {"spec": {"schedulingGates": list(gates)}}}
    return {
        "metadata": {k: meta[k] for k in keep if k in meta},
        "spec": slim_spec,
        "status": dict(body.get("status") or {}),
    }


RAY_CLUSTER_LABEL = "ray.io/cluster"  # KubeRay's label on every pod of a RayCluster
_pod_index: kopf.Index[tuple[str, str], dict[str, Any]] | None = None


@kopf.index("v1", "pods", labels={manifests.JOB_LABEL: kopf.PRESENT, RAY_CLUSTER_LABEL: kopf.PRESENT})
def rlhf_pods(
    namespace: str | None, labels: kopf.Labels, body: kopf.Body, **_: Any
) -> dict[tuple[str, str], dict[str, Any]]:
    """The pods of every job's RayCluster, by (namespace, RayCluster name), with only what the pod
    diagnosis and the engine plan read (pod_problems.slim_pod): a reconcile round reads them here instead
    of listing them from the API server."""
    slim = pod_problems.slim_pod(
        {"metadata": {**body.metadata, "namespace": namespace}, "status": body.status}
    )
    return {(namespace or "default", labels.get(RAY_CLUSTER_LABEL, "")): slim}


def use_index(
    index: kopf.Index[tuple[str, str], dict[str, Any]] | None,
    pods: kopf.Index[tuple[str, str], dict[str, Any]] | None = None,
) -> None:
    global _cluster_index, _pod_index
    if index is not None:
        _cluster_index = index
    if pods is not None:
        _pod_index = pods


def get_cluster(body: kopf.Body, name: str) -> dict[str, Any] | None:
    """The job's RayCluster as the watch last delivered it (or as this process just created it: for at
    most CONFIG.unseen_write_grace, so the next round does not take a cluster it just made for a missing one)."""
    namespace = body.metadata.namespace or "default"
    if _cluster_index is None:  # no index handed over yet (a unit test calling a helper): read it
        return kube.read_cluster(namespace, name)
    return runtime.state_of(body).expect.cluster_seen(
        next(iter(_cluster_index.get((namespace, name), ())), None)
    )


def cluster_pods(namespace: str, cluster_name: str) -> list[dict[str, Any]]:
    if _pod_index is not None:
        return list(_pod_index.get((namespace, cluster_name), ()))
    pods = k8s.CoreV1Api(kube.api()).list_namespaced_pod(
        namespace, label_selector=f"ray.io/cluster={cluster_name}"
    )
    return [cast(dict[str, Any], kube.api().sanitize_for_serialization(p)) for p in pods.items]  # type: ignore[no-untyped-call]


def container_log_tail(namespace: str, pod: str, container: str, lines: int) -> str:
    """The last `lines` lines of a container's log (the fetch step's progress; RBAC: pods/log get)."""
    return str(
        k8s.CoreV1Api(kube.api()).read_namespaced_pod_log(
            pod, namespace, container=container, tail_lines=lines
        )
    )


def rollout_pods(namespace: str, job: RLHFJob, cluster: dict[str, Any]) -> list[dict[str, Any]]:
    """The rollout worker pods, read only while KubeRay reports fewer ready workers than desired."""
    st = cluster.get("status") or {}
    if int(st.get("readyWorkerReplicas") or 0) >= int(st.get("desiredWorkerReplicas") or 0):
        return []
    if _pod_index is not None:
        return [
            p
            for p in _pod_index.get((namespace, cluster["metadata"]["name"]), ())
            if p["metadata"]["labels"].get(manifests.ROLE_LABEL) == "rollout"
        ]
    selector = f"{manifests.JOB_LABEL}={job.name},{manifests.ROLE_LABEL}=rollout"
    pods = k8s.CoreV1Api(kube.api()).list_namespaced_pod(namespace, label_selector=selector)
    return [cast(dict[str, Any], kube.api().sanitize_for_serialization(p)) for p in pods.items]  # type: ignore[no-untyped-call]


def remember_write(uid: str, fields: dict[str, Any]) -> None:
    runtime.JOBS.get(uid).expect.wrote_status(fields)


def awaiting_own_write(body: kopf.Body) -> bool:
    """True while the body still lacks the status fields this operator last wrote, or a new job still
    lacks the create handler's first phase (within the grace)."""
    expect = runtime.state_of(body).expect
    if not expect.expects_status():
        created = parse_time(body.metadata.creation_timestamp)
        young = (
            created is not None
            and (datetime.now(UTC) - created).total_seconds() < runtime.CONFIG.unseen_write_grace
        )
        return young and not body.status.get("phase")
    return expect.status_unseen(clean_status(dict(body.status)) or {})


def patch_in_flight(body: kopf.Body, cluster: dict[str, Any]) -> bool:
    """True while the cluster seen is the version this process last patched: the patch has not come back
    through the watch yet, and sending it again would be a second write of the same change."""
    return runtime.state_of(body).expect.patch_in_flight(
        (cluster.get("metadata") or {}).get("resourceVersion")
    )


def create_backing_off(body: kopf.Body) -> bool:
    """Whether a transient refusal's backoff (JobState.create_backoff, set by children.refused) still holds
    the next create."""
    entry = runtime.state_of(body).create_backoff
    return entry is not None and time.monotonic() < entry[1]
