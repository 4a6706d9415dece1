"""The objects a job owns and the writes to them: its token Secret and NetworkPolicy (in the order
security.creation_order decides: with a token, after the RayCluster), its RayCluster (create, adopt, refused
with backoff, patch), the stall's stacks ConfigMap, and spec.rollout.engines.

Every write is idempotent (deterministic names; 409 is the object this would make).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any, cast

import kopf
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException
from rlhf_api.spec import GROUP, PLURAL, VERSION, RLHFJob

from rlhf_operator import cache, diagnosis, failpoints, kube, manifests, metrics, rayjobs, runtime, security
from rlhf_operator.job_state import JobState
from rlhf_operator.status import cluster_rejected, status_patch

log = logging.getLogger("rlhf_operator")

# Creates the Secret and NetworkPolicy that follow a RayCluster, so the handler's thread is free for the next
# job's RayCluster; they wait on the API server, not on the CPU.
_SECURITY_POOL = ThreadPoolExecutor(
    max_workers=kube.BACKGROUND_THREADS, thread_name_prefix="security-objects"
)


def _security_objects(body: kopf.Body, job: RLHFJob) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The job's Secret and NetworkPolicy, owned by the job: (before its RayCluster, after it, in order)."""
    objs = manifests.security_objects(job, rayjobs.token_key(), runtime.CONFIG.policy_access)
    for obj in objs:
        kopf.adopt(obj, owner=body)
    return security.creation_order(objs)


def ensure_security_objects(body: kopf.Body, job: RLHFJob) -> None:
    """Create the job's token Secret and NetworkPolicy, owned by the job, if they do not exist yet, one after
    the other in `security.creation_order` (the NetworkPolicy before the Secret that lets pods start).

    Create only: the operator never reads a Secret (docs/security.md), and both objects are deterministic
    (the token is derived from the job's uid), so an existing one (409) is the one this would make.
    """
    namespace = body.metadata.namespace or "default"
    before, after = _security_objects(body, job)
    for obj in [*before, *after]:
        _create_security_object(namespace, obj)
    runtime.state_of(body).security = "made"


def settle_security_objects(body: kopf.Body, job: RLHFJob, cluster: dict[str, Any] | None) -> None:
    """A reconcile round's backstop (JobState.security_due): the objects a background creation failed to
    make, or a job's from before this operator version, made now; a refusal raises ClusterRefused."""
    if runtime.state_of(body).security_due(cluster is not None, body.status.get("phase")):
        ensure_security_objects(body, job)


def _create_security_object(namespace: str, obj: dict[str, Any]) -> None:
    try:
        if obj["kind"] == "Secret":
            k8s.CoreV1Api(kube.api()).create_namespaced_secret(namespace, obj)  # type: ignore[arg-type]
        else:
            k8s.NetworkingV1Api(kube.api()).create_namespaced_network_policy(namespace, obj)  # type: ignore[arg-type]
    except ApiException as e:
        if e.status != 409:
            raise ClusterRefused(
                e.status, f"{obj['kind']} {obj['metadata']['name']}: {kube.api_message(e)}"
            ) from e


def _follow_cluster(namespace: str, state: JobState, objs: list[dict[str, Any]]) -> None:
    """Create `objs` one after the other in the background, after the RayCluster. A failure is logged and
    leaves them to the next reconcile round (settle_security_objects), which says a refusal in the status."""
    try:
        for obj in objs:
            _create_security_object(namespace, obj)
        state.security = "made"
    except Exception as e:  # nobody waits on this future: say it here, the next round retries
        state.security = "unmade"
        log.warning("%s: security objects not created yet, the next round retries: %s", namespace, e)


def create_cluster(body: kopf.Body, job: RLHFJob) -> dict[str, Any]:
    """Create (or adopt) the job's RayCluster with its security objects in `security.creation_order`: those
    that must come first, then the RayCluster, then the rest in the background (no round trip of theirs
    stands between the job and its RayCluster: docs/benchmarks.md, operator_scale.py)."""
    namespace = body.metadata.namespace or "default"
    before, after = _security_objects(body, job)
    for obj in before:
        _create_security_object(namespace, obj)
    created = _post_cluster(body, job)
    state = runtime.state_of(body)
    if not after:
        state.security = "made"
    elif state.security == "unmade":
        state.security = "creating"
        _SECURITY_POOL.submit(_follow_cluster, namespace, state, after)
    return created


def _post_cluster(body: kopf.Body, job: RLHFJob) -> dict[str, Any]:
    """POST the job's RayCluster, owned by the job; a 409 adopts the one an earlier incarnation made."""
    manifest = manifests.build_raycluster(job, default_image=runtime.CONFIG.default_trainer_image)
    kopf.adopt(manifest, owner=body)  # owner reference: deleting the job deletes the cluster
    namespace = body.metadata.namespace or "default"
    try:
        created = cast(
            dict[str, Any],
            kube.custom().create_namespaced_custom_object(
                kube.RAY_GROUP, kube.RAY_VERSION, namespace, kube.RAY_PLURAL, manifest
            ),
        )
    except ApiException as e:
        if e.status == 409:  # created by an earlier incarnation of this operator: adopt it
            existing = kube.read_cluster(namespace, manifest["metadata"]["name"])
            if existing is not None:
                runtime.state_of(body).expect.created_cluster(cache.slim_raycluster(existing))
                return existing
        raise ClusterRefused(e.status, kube.api_message(e)) from e
    metrics.CLUSTERS_CREATED.labels(namespace).inc()
    # As the index keeps it: the whole answer (pod templates) for each of a burst of new jobs was
    # the largest thing the operator kept after the watch events (benchmarks.md, Round 3).
    state = runtime.state_of(body)
    state.expect.created_cluster(cache.slim_raycluster(created))
    state.create_backoff = None
    failpoints.hit("after_cluster_create")
    kopf.event(
        body,
        type="Normal",
        reason="RayClusterCreated",
        message=f"created RayCluster {manifest['metadata']['name']}",
    )
    for warning in security.disabled_warnings(job):
        kopf.event(body, type="Warning", reason="SecurityDisabled", message=warning)
    return created


class ClusterRefused(Exception):
    """The API server refused to create the RayCluster (status.cluster_rejected says what that means)."""

    def __init__(self, code: int | None, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


def refused(body: kopf.Body, patch: kopf.Patch, job: RLHFJob, refusal: ClusterRefused) -> None:
    """Write what the refusal means to the status and the events; retry a transient one with backoff
    (1 s, doubling to 60 s), a permanent one never."""
    decision = cluster_rejected(job, refusal.code, refusal.message, datetime.now(UTC))
    current = cache.clean_status(dict(body.status)) or {}
    changes = status_patch(current, decision.status)
    for key, value in changes.items():
        patch.status[key] = value
    cache.remember_write(body.metadata.uid or "", changes)
    for etype, reason, message in decision.events:
        kopf.event(body, type=etype, reason=reason, message=message)
    namespace = body.metadata.namespace or "default"
    metrics.RECONCILE_ERRORS.labels(namespace, "RayClusterRefused").inc()
    state = runtime.state_of(body)
    if decision.status.get("phase") == "Failed":
        state.create_backoff = None
        return
    count = (state.create_backoff or (0, 0.0))[0]
    delay = min(2.0**count, 60.0)
    state.create_backoff = (count + 1, time.monotonic() + delay)
    log.warning("RayCluster for %s/%s refused, retrying in %.0fs: %s", namespace, job.name, delay, refusal)


def patch_raycluster(
    job_body: kopf.Body, cluster: dict[str, Any], body: Any, content_type: str | None = None
) -> None:
    namespace = job_body.metadata.namespace or "default"
    kube.custom().patch_namespaced_custom_object(
        kube.RAY_GROUP,
        kube.RAY_VERSION,
        namespace,
        kube.RAY_PLURAL,
        cluster["metadata"]["name"],
        body,
        _content_type=content_type,
    )
    version = (cluster.get("metadata") or {}).get("resourceVersion") or ""
    runtime.state_of(job_body).expect.patched_cluster(version)


def record_stacks(body: kopf.Body, job: RLHFJob, status: dict[str, Any], stacks: dict[str, Any]) -> None:
    """Create or replace the ConfigMap <job>-stacks with the snapshot (owned by the job). A refusal is
    logged and said in an Event, never fatal: the verdict is in the status and the Event already."""
    namespace = body.metadata.namespace or "default"
    conditions: list[dict[str, Any]] = status.get("conditions") or []
    stall = next((str(c.get("message", "")) for c in conditions if c.get("type") == "Stalled"), "")
    owner = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "RLHFJob",
        "name": job.name,
        "uid": body.metadata.uid or "",
        "controller": True,
    }
    cm = diagnosis.config_map(job.name, namespace, owner, str(stall), status.get("diagnosis") or {}, stacks)
    core = k8s.CoreV1Api(kube.api())
    try:
        try:
            core.create_namespaced_config_map(namespace, cm)  # type: ignore[arg-type]
        except ApiException as e:
            if e.status != 409:
                raise
            core.replace_namespaced_config_map(cm["metadata"]["name"], namespace, cm)  # type: ignore[arg-type]
    except ApiException as e:
        log.warning("writing %s/%s: %s", namespace, cm["metadata"]["name"], kube.api_message(e))
        kopf.event(body, type="Warning", reason="StallDiagnosisNotKept", message=kube.api_message(e)[:500])
        return
    if status.get("diagnosis"):
        status["diagnosis"]["configMap"] = cm["metadata"]["name"]


def write_engines(namespace: str, name: str, requested: int, engines: int) -> bool:
    """Set spec.rollout.engines to `engines` if it still is `requested` (JSON-patch test); False if not."""
    ops = [
        {"op": "test", "path": "/spec/rollout/engines", "value": requested},
        {"op": "replace", "path": "/spec/rollout/engines", "value": engines},
    ]
    try:
        kube.custom().patch_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, name, ops, _content_type=kube.JSON_PATCH
        )
    except ApiException as e:
        if e.status in (409, 422):  # test failed (changed meanwhile) or admission refused it
            log.warning(
                "%s/%s: not setting rollout.engines %s→%s: %s", namespace, name, requested, engines, e.body
            )
            return False
        raise
    return True
