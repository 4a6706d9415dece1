"""kopf handlers: the create event, the reconcile timer (observe, decide, act, patch the status diff) and the
deletion, which forgets the job (one pop of its state, job_state.py).

Thin by design: what to build lives in `manifests`, what phase/actions follow lives in `status`, the
engine count lives in `scaling`; the I/O is in `cache`, `children`, `observe` and `act`.
Every handler is idempotent (deterministic names and submission ids), so a SIGKILLed operator
restarts without creating a second RayCluster or submitting a trainer twice.
"""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime
from typing import Any

import kopf
from kubernetes.client.exceptions import ApiException
from rlhf_api.spec import GROUP, PLURAL, TERMINAL_JOB_PHASES, VERSION

from rlhf_operator import (
    act,
    cache,
    children,
    failpoints,
    manifests,
    metrics,
    observe,
    rayjobs,
    runtime,
    runtimes,
    throttle,
)
from rlhf_operator.conditions import set_condition
from rlhf_operator.status import decide, status_patch

log = logging.getLogger("rlhf_operator")


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    # Progress and diff-base in our own annotations; the status subresource stays ours alone.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration"
    )
    settings.posting.level = logging.INFO
    settings.watching.server_timeout = 60
    settings.watching.client_timeout = 90
    settings.watching.reconnect_backoff = 1.0
    settings.networking.request_timeout = 30
    settings.execution.max_workers = runtime.CONFIG.handler_threads
    settings.queueing.idle_timeout = runtime.CONFIG.worker_idle_seconds
    # A deletion waits for a running reconcile timer to exit before the finalizer goes; kopf re-checks
    # every 60 s by default, which held deleted jobs (and TTL deletions) for a minute.
    settings.background.cancellation_polling = 1.0
    # The RayCluster and pod watches (the indexes in cache.py) ask the API server for our objects only, instead
    # of every RayCluster and pod of the cluster filtered here.
    settings.watching.label_selectors["ray.io", "rayclusters"] = manifests.JOB_LABEL
    settings.watching.label_selectors["v1", "pods"] = manifests.JOB_LABEL
    if runtime.CONFIG.metrics_port:
        metrics.serve(runtime.CONFIG.metrics_port, runtime.CONFIG.metrics_addr)


def _invalid(body: kopf.Body, patch: kopf.Patch, message: str) -> None:
    """Fail a job whose spec (or, on a runtime, whose merged spec) is invalid, at once and once: no restart
    would change it. A runtime problem also sets the RuntimeBound condition, with its reason."""
    problem = runtime.state_of(body).runtime
    problem = problem if isinstance(problem, runtimes.RuntimeUnusable) else None
    reason = problem.reason if problem else "InvalidSpec"
    text = f"invalid spec: {message}"
    if body.status.get("phase") != "Failed" or body.status.get("message") != text:
        patch.status["phase"] = "Failed"
        patch.status["message"] = text
        if problem:
            patch.status["conditions"] = set_condition(
                list(body.status.get("conditions") or []), runtimes.CONDITION, False, reason, message,
                datetime.now(UTC), body.metadata.get("generation"),
            )  # fmt: skip
        kopf.event(body, type="Warning", reason=reason, message=message)
    metrics.RECONCILE_ERRORS.labels(body.metadata.namespace or "", reason).inc()


def _runtime_status(body: kopf.Body, conditions: list[dict[str, Any]]) -> dict[str, Any]:
    """status.runtime and the RuntimeBound condition (over `conditions`) of a job on a runtime, and its
    per-job checkpoint claim, made here once; {} when the status has them already or there is no runtime."""
    bound = runtimes.bound(body)
    if bound is None:
        return {}
    want = bound.status(runtimes.ensure_claim(body, bound))
    if body.status.get("runtime") == want:
        return {}
    message = f"{bound.ref} generation {bound.generation}, copied to ConfigMap {bound.configmap}"
    now, generation = datetime.now(UTC), body.metadata.get("generation")
    return {
        "runtime": want,
        "conditions": set_condition(conditions, runtimes.CONDITION, True, "Bound", message, now, generation),
    }


@kopf.on.event(GROUP, VERSION, PLURAL)
def on_event(
    type: str,
    body: kopf.Body,
    patch: kopf.Patch,
    rayclusters: kopf.Index[tuple[str, str], dict[str, Any]] | None = None,
    rlhf_pods: kopf.Index[tuple[str, str], dict[str, Any]] | None = None,
    **_: Any,
) -> None:
    """Create a new job's RayCluster from the watch event itself.

    An event handler needs no finalizer first: kopf's create handler would wait for its finalizer patch
    to come back through the watch, two API round trips and two watch deliveries before the RayCluster's
    POST (benchmarks/operator_scale.py). The reconcile timer stays the level-triggered fallback: it
    creates a missing cluster too. Idempotent under SIGKILL: the RayCluster's name is the job's, and a
    409 adopts the one an earlier incarnation made.
    """
    cache.use_index(rayclusters, rlhf_pods)
    if type == "DELETED" or body.metadata.get("deletionTimestamp"):
        # At the deletion's first event, while the timers' finalizer still holds the job (kopf handles
        # this event's watchers before it releases the finalizer), and at its last.
        _forget(body)
        return
    if body.status.get("phase") in TERMINAL_JOB_PHASES:
        return
    if body.status.get("phase") or runtime.state_of(body).first_written:
        return  # under way: the reconcile timer's (its first status write may still be on its way)
    ensure_cluster(body, patch)


def ensure_cluster(body: kopf.Body, patch: kopf.Patch) -> None:
    """Create the RayCluster of a job with no phase yet, and write its first phase."""
    job = cache.parse(body)
    if isinstance(job, str):
        _invalid(body, patch, job)
        return
    if cache.get_cluster(body, manifests.raycluster_name(job.name)) is None:
        try:
            children.create_cluster(body, job)
        except children.ClusterRefused as refusal:
            children.refused(body, patch, job, refusal)
            return  # the reconcile timer retries a transient refusal, after the backoff
    first = {
        **_runtime_status(body, list(body.status.get("conditions") or [])),
        "phase": "Provisioning",
        "rayClusterName": manifests.raycluster_name(job.name),
        "totalSteps": job.spec.algorithm.total_steps,
        "restarts": 0,
        "observedGeneration": body.metadata.get("generation"),
        "message": "RayCluster created; waiting for it to be ready",
    }
    for key, value in first.items():
        patch.status[key] = value
    cache.remember_write(body.metadata.uid or "", first)
    runtime.state_of(body).first_written = True


def _first_round_delay(**_: Any) -> float:
    return throttle.first_delay(runtime.CONFIG.reconcile_interval)


@kopf.timer(
    GROUP,
    VERSION,
    PLURAL,
    interval=runtime.CONFIG.reconcile_interval,
    initial_delay=_first_round_delay,
    sharp=False,
)
def reconcile(
    body: kopf.Body,
    patch: kopf.Patch,
    rayclusters: kopf.Index[tuple[str, str], dict[str, Any]] | None = None,
    rlhf_pods: kopf.Index[tuple[str, str], dict[str, Any]] | None = None,
    **_: Any,
) -> None:
    """The level-triggered loop: observe, decide, act, and patch only what changed."""
    cache.use_index(rayclusters, rlhf_pods)
    started = time.monotonic()
    namespace = body.metadata.namespace or "default"
    job = cache.parse(body)
    if isinstance(job, str):
        _invalid(body, patch, job)
        return
    if cache.awaiting_own_write(body):
        return  # this body predates our last write (or the create handler's first): next round
    try:
        attempt = int(body.status.get("restarts") or 0)
        preemptions = int(body.status.get("preemptions") or 0)
        submission = manifests.submission_id(job, body.metadata.uid or "", attempt, preemptions)
        observed = observe.observe(body, job, submission)
        decision = decide(job, observed, submission)
        # Before acting: a stall's series exists before the stuck attempt is stopped, so the stall alert
        # goes on from the trainer's own series to it without a gap (docs/monitoring.md).
        metrics.record_open_stall(namespace, job.name, decision.status.get("openStall"))
        if decision.status.get("phase") == "Restarting" and body.status.get("phase") != "Restarting":
            failpoints.hit("after_restart_decision")
        if decision.holds_round:
            return  # a transient refusal's backoff: the status already says why
        try:
            status = act.act(body, job, observed, decision)
            children.settle_security_objects(body, job, observed.raycluster)
        except children.ClusterRefused as refusal:
            children.refused(body, patch, job, refusal)
            return
        except act.Replan as e:
            log.info("%s/%s: %s: planning again next round", namespace, job.name, e)
            return
        failpoints.hit("before_status_patch")
    except (ApiException, rayjobs.RayJobsError) as e:
        metrics.RECONCILE_ERRORS.labels(namespace, type(e).__name__).inc()
        raise kopf.TemporaryError(f"reconcile: {e}", delay=2) from e
    current = cache.clean_status(dict(body.status)) or {}
    changes = status_patch(current, status)
    # A job bound before this operator version wrote status.runtime, or whose first write was lost.
    base = changes.get("conditions") or status.get("conditions") or current.get("conditions") or []
    changes.update(_runtime_status(body, list(base)))
    for key, value in changes.items():
        patch.status[key] = value
    cache.remember_write(body.metadata.uid or "", changes)
    metrics.record_job_phase(namespace, job.name, status.get("phase"))
    metrics.RECONCILE_SECONDS.observe(time.monotonic() - started)


# Submission ids of deleted jobs whose Ray job this process has stopped (development override only): the
# deletion's first and last events both forget the job, and the stop is sent once. A few tombstones, not
# per-job state: the oldest go first.
_STOPPED_KEPT = 256
_stopped: dict[str, None] = {}


def _forget(body: kopf.Body) -> None:
    """A deleted job: drop what this process kept about it (one pop: job_state.JobStates.forget) and close
    its Jobs API connections, and (development override only) stop its Ray job, best effort (in a cluster
    the RayCluster's deletion ends the job with it)."""
    namespace, name = body.metadata.namespace or "default", body.metadata.name or ""
    metrics.record_job_phase(namespace, name, None)
    metrics.record_open_stall(namespace, name, None)
    sid = body.status.get("submissionId")
    try:
        if sid and runtime.CONFIG.dev_head_host and sid not in _stopped:
            _stopped[sid] = None
            while len(_stopped) > _STOPPED_KEPT:
                del _stopped[next(iter(_stopped))]
            with (
                runtime.REMOTE.slot(observe.dashboard_url(None)),
                observe.ray_client(observe.dashboard_url(None), body) as rj,
            ):
                rj.stop(sid)
    except rayjobs.RayJobsError as e:
        log.warning("could not stop %s: %s", sid, e)
    finally:
        state = runtime.JOBS.forget(body.metadata.uid or "")
        if state is not None:
            state.close()
