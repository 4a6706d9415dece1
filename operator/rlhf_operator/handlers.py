"""kopf handlers: observe (RayCluster, Ray job, trainer metrics), call the pure functions, act, patch status.

Thin by design: what to build lives in `manifests`, what phase/actions follow lives in `status`, the
engine count (clamp, built-in autoscaler, pending workers) lives in `scaling`.
Every handler is idempotent (deterministic names and submission ids), so a SIGKILLed operator
restarts without creating a second RayCluster or submitting a trainer twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any, cast

import aiohttp
import kopf
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError
from rlhf_api.spec import GROUP, PLURAL, TERMINAL_JOB_PHASES, VERSION, RLHFJob

from rlhf_operator import (
    config,
    diagnosis,
    failpoints,
    kueue,
    manifests,
    metrics,
    pod_problems,
    rayjobs,
    scaling,
    scrape,
    security,
    throttle,
)
from rlhf_operator.conditions import parse_time
from rlhf_operator.job_state import JobState, JobStates
from rlhf_operator.status import Decision, Observed, cluster_rejected, decide, status_patch

log = logging.getLogger("rlhf_operator")

RAY_GROUP, RAY_VERSION, RAY_PLURAL = "ray.io", "v1", "rayclusters"
JSON_PATCH = "application/json-patch+json"
# The configuration, read once (config.py); the chart sets its environment variables.
CONFIG = config.from_env()
# Calls to Ray heads (Jobs API, trainer /metrics): capped in total and per host (throttle.py).
REMOTE = throttle.RemoteLimiter(CONFIG.remote_concurrency, CONFIG.remote_per_host)
_api: k8s.ApiClient | None = None

# Everything kept per job (job_state.py), by uid: `_forget` drops a deleted job's in one pop. A write of
# ours may stay unseen by the watch for CONFIG.unseen_write_grace (expectations.py): a round is skipped
# while the body lacks our last status write, and a new job is left to the create handler until it has
# written the first phase; a RayCluster just created or patched is taken as written.
JOBS = JobStates(CONFIG.unseen_write_grace)


def _state(body: kopf.Body) -> JobState:
    return JOBS.get(body.metadata.uid or "")


def api() -> k8s.ApiClient:
    global _api
    if _api is None:
        try:
            k8s_config.load_incluster_config()  # type: ignore[no-untyped-call]
        except k8s_config.ConfigException:
            k8s_config.load_kube_config()  # type: ignore[no-untyped-call]
        cfg = k8s.Configuration.get_default_copy()
        cfg.connection_pool_maxsize = CONFIG.handler_threads
        _api = k8s.ApiClient(cfg)
    return _api


def custom() -> k8s.CustomObjectsApi:
    return k8s.CustomObjectsApi(api())


@kopf.on.login()
async def login(logger: kopf.Logger, settings: kopf.OperatorSettings, **_: Any) -> kopf.AiohttpSession | None:
    """kopf's own login (in-cluster, else kubeconfig), on a session of at most RLHF_API_CONNECTIONS connections."""
    info = await asyncio.to_thread(kopf.login_via_client, logger=logger, settings=settings)
    return None if info is None else api_session(info, CONFIG.api_connections)


def api_session(info: kopf.ConnectionInfo, connections: int) -> kopf.AiohttpSession:
    """The session kopf would make for `info`, but of at most `connections` connections (in the loop)."""
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=connections, ssl=info.as_ssl_context()),
        headers=info.as_http_headers(),
        proxy=info.proxy_url,
        trust_env=info.trust_env,
    )
    return kopf.AiohttpSession(
        server=info.server,
        default_namespace=info.default_namespace,
        expiration=info.expiration,
        priority=info.priority,
        aiohttp_session=session,
    )


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
    settings.execution.max_workers = CONFIG.handler_threads
    settings.queueing.idle_timeout = CONFIG.worker_idle_seconds
    # A deletion waits for a running reconcile timer to exit before the finalizer goes; kopf re-checks
    # every 60 s by default, which held deleted jobs (and TTL deletions) for a minute.
    settings.background.cancellation_polling = 1.0
    # The RayCluster and pod watches (the indexes below) ask the API server for our objects only, instead
    # of every RayCluster and pod of the cluster filtered here.
    settings.watching.label_selectors["ray.io", "rayclusters"] = manifests.JOB_LABEL
    settings.watching.label_selectors["v1", "pods"] = manifests.JOB_LABEL
    if CONFIG.metrics_port:
        metrics.serve(CONFIG.metrics_port, CONFIG.metrics_addr)


def _parse(body: kopf.Body) -> RLHFJob | str:
    """The typed job, or the validation error text (a bad object must never crash the operator); the last
    parse is reused while the resourceVersion is the same (JobState.parsed)."""
    uid, version = body.metadata.uid or "", str(body.metadata.get("resourceVersion") or "")
    state = JOBS.peek(uid)
    cached = state.parsed if state is not None else None
    if cached is not None and version and cached[0] == version:
        return cached[1]
    result = _validate(body)
    if uid and version:
        JOBS.get(uid).parsed = (version, result)
    return result


def _validate(body: kopf.Body) -> RLHFJob | str:
    try:
        return RLHFJob.model_validate(
            {
                "apiVersion": body.get("apiVersion"),
                "kind": body.get("kind"),
                "metadata": dict(body.metadata),
                "spec": dict(body.spec),
                "status": _clean_status(dict(body.status)),
            }
        )
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(x) for x in first["loc"])
        return f"{loc}: {first['msg']} ({e.error_count()} error(s))"


def _clean_status(status: dict[str, Any]) -> dict[str, Any] | None:
    status.pop("kopf", None)
    return status or None


def _invalid(body: kopf.Body, patch: kopf.Patch, message: str) -> None:
    if body.status.get("phase") != "Failed" or body.status.get("message") != message:
        patch.status["phase"] = "Failed"
        patch.status["message"] = f"invalid spec: {message}"
        kopf.event(body, type="Warning", reason="InvalidSpec", message=message)
    metrics.RECONCILE_ERRORS.labels(body.metadata.namespace or "", "InvalidSpec").inc()


# RayClusters are read from a kopf index fed by a watch (`rayclusters` below), not by a GET per round.
# The index is handed to handlers as a keyword argument; they keep it here for the helpers they call.
_cluster_index: kopf.Index[tuple[str, str], dict[str, Any]] | None = None


@kopf.index(RAY_GROUP, RAY_VERSION, RAY_PLURAL, labels={manifests.JOB_LABEL: kopf.PRESENT})
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


def _use_index(
    index: kopf.Index[tuple[str, str], dict[str, Any]] | None,
    pods: kopf.Index[tuple[str, str], dict[str, Any]] | None = None,
) -> None:
    global _cluster_index, _pod_index
    if index is not None:
        _cluster_index = index
    if pods is not None:
        _pod_index = pods


def _get_cluster(body: kopf.Body, name: str) -> dict[str, Any] | None:
    """The job's RayCluster as the watch last delivered it (or as this process just created it: for at
    most CONFIG.unseen_write_grace, so the next round does not take a cluster it just made for a missing one)."""
    namespace = body.metadata.namespace or "default"
    if _cluster_index is None:  # no index handed over yet (a unit test calling a helper): read it
        return _read_cluster(namespace, name)
    return _state(body).expect.cluster_seen(next(iter(_cluster_index.get((namespace, name), ())), None))


def _read_cluster(namespace: str, name: str) -> dict[str, Any] | None:
    try:
        obj = custom().get_namespaced_custom_object(RAY_GROUP, RAY_VERSION, namespace, RAY_PLURAL, name)
        return cast(dict[str, Any], obj)
    except ApiException as e:
        if e.status == 404:
            return None
        raise


def _ensure_security_objects(body: kopf.Body, job: RLHFJob) -> None:
    """Create the job's token Secret and NetworkPolicy, owned by the job, if they do not exist yet.

    Create only: the operator never reads a Secret (docs/security.md), and both objects are deterministic
    (the token is derived from the job's uid), so an existing one (409) is the one this would make.
    """
    namespace = body.metadata.namespace or "default"
    objs = manifests.security_objects(job, rayjobs.token_key(), CONFIG.policy_access)
    for obj in objs:
        kopf.adopt(obj, owner=body)
    # Both at once: one round trip before the RayCluster's POST instead of two.
    for future in [_SECURITY_POOL.submit(_create_security_object, namespace, obj) for obj in objs]:
        future.result()
    _state(body).security_ensured = True


def _create_security_object(namespace: str, obj: dict[str, Any]) -> None:
    try:
        if obj["kind"] == "Secret":
            k8s.CoreV1Api(api()).create_namespaced_secret(namespace, obj)  # type: ignore[arg-type]
        else:
            k8s.NetworkingV1Api(api()).create_namespaced_network_policy(namespace, obj)  # type: ignore[arg-type]
    except ApiException as e:
        if e.status != 409:
            raise ClusterRefused(
                e.status, f"{obj['kind']} {obj['metadata']['name']}: {_api_message(e)}"
            ) from e


_SECURITY_POOL = ThreadPoolExecutor(max_workers=4, thread_name_prefix="security-objects")


@contextlib.contextmanager
def _ray_client(url: str, body: kopf.Body) -> Iterator[rayjobs.RayJobsClient]:
    """The job's Jobs API client for this head, kept between rounds (JobState.ray_clients): its connection
    stays open, where a client per round paid for a new client and a TCP connection every round of every
    job."""
    clients = _state(body).ray_clients
    client = clients.get(url)
    if client is None:
        client = clients[url] = rayjobs.RayJobsClient(url, token=ray_token(body))
    try:
        yield client
    except rayjobs.RayJobsError:
        clients.pop(url, None)  # a fresh client (and connection) next time
        client.close()
        raise


def ray_token(body: kopf.Body) -> str:
    """The job's Ray token, sent on every Jobs API call (a head without token authentication ignores it)."""
    meta = body.metadata
    return security.job_token(
        rayjobs.token_key(), meta.namespace or "default", meta.name or "", meta.uid or ""
    )


def _create_cluster(body: kopf.Body, job: RLHFJob) -> dict[str, Any]:
    _ensure_security_objects(body, job)
    manifest = manifests.build_raycluster(job, default_image=CONFIG.default_trainer_image)
    kopf.adopt(manifest, owner=body)  # owner reference: deleting the job deletes the cluster
    namespace = body.metadata.namespace or "default"
    try:
        created = cast(
            dict[str, Any],
            custom().create_namespaced_custom_object(RAY_GROUP, RAY_VERSION, namespace, RAY_PLURAL, manifest),
        )
        metrics.CLUSTERS_CREATED.labels(namespace).inc()
        # As the index keeps it: the whole answer (pod templates) for each of a burst of new jobs was
        # the largest thing the operator kept after the watch events (benchmarks.md, Round 3).
        state = _state(body)
        state.expect.created_cluster(slim_raycluster(created))
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
    except ApiException as e:
        if e.status == 409:  # created by an earlier incarnation of this operator: adopt it
            existing = _read_cluster(namespace, manifest["metadata"]["name"])
            if existing is not None:
                _state(body).expect.created_cluster(slim_raycluster(existing))
                return existing
        raise ClusterRefused(e.status, _api_message(e)) from e


class ClusterRefused(Exception):
    """The API server refused to create the RayCluster (status.cluster_rejected says what that means)."""

    def __init__(self, code: int | None, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


def _api_message(e: ApiException) -> str:
    """The server's own words (the Status object's message), else the HTTP reason."""
    try:
        return str(json.loads(e.body or "{}").get("message") or e.reason)
    except (ValueError, AttributeError):
        return str(e.reason)


def _create_backing_off(body: kopf.Body) -> bool:
    """Whether a transient refusal's backoff (JobState.create_backoff) still holds the next create."""
    entry = _state(body).create_backoff
    return entry is not None and time.monotonic() < entry[1]


def _refused(body: kopf.Body, patch: kopf.Patch, job: RLHFJob, refusal: ClusterRefused) -> None:
    """Write what the refusal means to the status and the events; retry a transient one with backoff
    (1 s, doubling to 60 s), a permanent one never."""
    decision = cluster_rejected(job, refusal.code, refusal.message, datetime.now(UTC))
    current = _clean_status(dict(body.status)) or {}
    changes = status_patch(current, decision.status)
    for key, value in changes.items():
        patch.status[key] = value
    _remember_write(body.metadata.uid or "", changes)
    for etype, reason, message in decision.events:
        kopf.event(body, type=etype, reason=reason, message=message)
    namespace = body.metadata.namespace or "default"
    metrics.RECONCILE_ERRORS.labels(namespace, "RayClusterRefused").inc()
    state = _state(body)
    if decision.status.get("phase") == "Failed":
        state.create_backoff = None
        return
    count = (state.create_backoff or (0, 0.0))[0]
    delay = min(2.0**count, 60.0)
    state.create_backoff = (count + 1, time.monotonic() + delay)
    log.warning("RayCluster for %s/%s refused, retrying in %.0fs: %s", namespace, job.name, delay, refusal)


def _remember_write(uid: str, fields: dict[str, Any]) -> None:
    JOBS.get(uid).expect.wrote_status(fields)


def _awaiting_own_write(body: kopf.Body) -> bool:
    """True while the body still lacks the status fields this operator last wrote, or a new job still
    lacks the create handler's first phase (within the grace)."""
    expect = _state(body).expect
    if not expect.expects_status():
        created = parse_time(body.metadata.creation_timestamp)
        young = (
            created is not None and (datetime.now(UTC) - created).total_seconds() < CONFIG.unseen_write_grace
        )
        return young and not body.status.get("phase")
    return expect.status_unseen(_clean_status(dict(body.status)) or {})


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
    _use_index(rayclusters, rlhf_pods)
    if type == "DELETED" or body.metadata.get("deletionTimestamp"):
        # At the deletion's first event, while the timers' finalizer still holds the job (kopf handles
        # this event's watchers before it releases the finalizer), and at its last.
        _forget(body)
        return
    if body.status.get("phase") in TERMINAL_JOB_PHASES:
        return
    state = _state(body)
    if body.status.get("phase"):
        if not type and not state.security_ensured:  # the initial listing (no type): the operator's start
            _resume_security_objects(body)
        return
    if state.first_written:
        return  # its first status write is on its way through the watch
    ensure_cluster(body, patch)


def _resume_security_objects(body: kopf.Body) -> None:
    """A job from before this operator version, or whose NetworkPolicy was deleted, gets its objects
    again: once per job and process."""
    job = _parse(body)
    if isinstance(job, str):
        return
    namespace = body.metadata.namespace or "default"
    if _get_cluster(body, manifests.raycluster_name(job.name)) is None:
        return
    try:
        _ensure_security_objects(body, job)
    except ClusterRefused as e:
        log.warning("%s/%s: security objects not created: %s", namespace, job.name, e)


def ensure_cluster(body: kopf.Body, patch: kopf.Patch) -> None:
    """Create the RayCluster of a job with no phase yet, and write its first phase."""
    job = _parse(body)
    if isinstance(job, str):
        _invalid(body, patch, job)
        return
    if _get_cluster(body, manifests.raycluster_name(job.name)) is None:
        try:
            _create_cluster(body, job)
        except ClusterRefused as refusal:
            _refused(body, patch, job, refusal)
            return  # the reconcile timer retries a transient refusal, after the backoff
    first = {
        "phase": "Provisioning",
        "rayClusterName": manifests.raycluster_name(job.name),
        "totalSteps": job.spec.algorithm.total_steps,
        "restarts": 0,
        "observedGeneration": body.metadata.get("generation"),
        "message": "RayCluster created; waiting for it to be ready",
    }
    for key, value in first.items():
        patch.status[key] = value
    _remember_write(body.metadata.uid or "", first)
    _state(body).first_written = True


def dashboard_url(cluster: dict[str, Any] | None) -> str:
    """The Ray dashboard (Jobs API) of a RayCluster's head, or of the development head."""
    port = CONFIG.dev_dashboard_port if CONFIG.dev_head_host else manifests.DASHBOARD_PORT
    return manifests.head_url(cluster, port, CONFIG.dev_head_host)


def metrics_url(cluster: dict[str, Any], job: RLHFJob) -> str:
    """The trainer's /metrics, served by the driver on the head."""
    return manifests.head_url(cluster, job.spec.monitoring.metrics_port, CONFIG.dev_head_host) + "/metrics"


def observe(body: kopf.Body, job: RLHFJob, submission: str) -> Observed:
    namespace = body.metadata.namespace or "default"
    cluster = _get_cluster(body, manifests.raycluster_name(job.name))
    obs: dict[str, Any] = {"now": datetime.now(UTC), "uid": body.metadata.uid or "", "raycluster": cluster}
    queue = kueue.queue_name(job.metadata.get("labels"), cluster)
    if cluster is not None and kueue.suspended_by_kueue(cluster, queue is not None):
        obs["workload"] = _workload(namespace, cluster)
        return Observed(**obs)  # nothing runs: no Jobs API, no scrape, no pods to read
    if cluster is not None and cluster.get("status", {}).get("state") != "ready":
        obs["pods"] = _cluster_pods(namespace, cluster["metadata"]["name"])
    if cluster is not None and cluster.get("status", {}).get("state") == "ready":
        try:
            url = dashboard_url(cluster)
            with REMOTE.slot(url), _ray_client(url, body) as rj:
                obs["ray_job"] = rj.get(body.status.get("submissionId") or submission)
                if obs["ray_job"] is None:  # about to submit: is the attempt before still stopping?
                    obs["previous_running"] = _previous_running(rj, body, job)
        except rayjobs.RayJobsError as e:
            obs["ray_job_error"] = str(e)
        if obs.get("ray_job") is not None and obs["ray_job"].status == rayjobs.RUNNING:
            obs.update(_scrape(body, job, cluster))
        taking = body.status.get("diagnosis") or {}
        if taking.get("state") == "Taking" and obs.get("ray_job_error") is None:
            obs["stacks"] = _snapshot_result(cluster, body, str(taking.get("submissionId")))
    return Observed(**obs)


def _snapshot_result(cluster: dict[str, Any], body: kopf.Body, sid: str) -> diagnosis.SnapshotResult | None:
    """The stall's snapshot job: running (not done), or ended with the snapshot its log ends with."""
    url = dashboard_url(cluster)
    try:
        with REMOTE.slot(url), _ray_client(url, body) as rj:
            info = rj.get(sid)
            if info is None:
                return diagnosis.SnapshotResult(True, error=f"its Ray job {sid} is gone (a new Ray head?)")
            if info.status not in rayjobs.TERMINAL:
                return diagnosis.SnapshotResult(False)
            log_text = rj.logs(sid)
    except rayjobs.RayJobsError as e:
        log.warning("reading the stack snapshot %s: %s", sid, e)
        return None  # not known this round: the time limit still runs
    snap = diagnosis.parse_log(log_text)
    if snap is not None:
        return diagnosis.SnapshotResult(True, snap)
    tail = " ".join(log_text.strip().splitlines()[-3:])[-300:] or info.message[-300:]
    return diagnosis.SnapshotResult(True, error=f"its Ray job {sid} ended {info.status}: {tail}")


def _previous_running(rj: rayjobs.RayJobsClient, body: kopf.Body, job: RLHFJob) -> str | None:
    """The id of the previous attempt if its Ray job has not ended (on a new head it is unknown: ended)."""
    attempt, preemptions = int(body.status.get("restarts") or 0), int(body.status.get("preemptions") or 0)
    for sid in manifests.previous_submission_ids(job, body.metadata.uid or "", attempt, preemptions):
        info = rj.get(sid)
        if info is not None and info.status not in rayjobs.TERMINAL:
            return sid
    return None


_workload_version: list[str] = list(kueue.WORKLOAD_VERSIONS)  # the first is the one this API server serves


def _workload(namespace: str, cluster: dict[str, Any]) -> dict[str, Any] | None:
    """Kueue's Workload for a RayCluster it holds (by Kueue's job-uid label), slimmed; None if none yet.

    Read only while the cluster is held suspended, so a queued job costs one LIST per round and a
    running one none."""
    uid = (cluster.get("metadata") or {}).get("uid")
    if not uid:
        return None
    while _workload_version:
        try:
            found = custom().list_namespaced_custom_object(
                kueue.WORKLOAD_GROUP,
                _workload_version[0],
                namespace,
                kueue.WORKLOAD_PLURAL,
                label_selector=f"{kueue.JOB_UID_LABEL}={uid}",
            )
        except ApiException as e:
            if e.status == 404 and len(_workload_version) > 1:
                _workload_version.pop(0)  # an older Kueue: its API version
                continue
            if e.status in (403, 404):
                log.warning("cannot read Kueue Workloads in %s: %s", namespace, _api_message(e))
                return None
            raise
        listed: list[dict[str, Any]] = cast(dict[str, Any], found).get("items") or []
        items = sorted(listed, key=lambda w: (w.get("metadata") or {}).get("creationTimestamp") or "")
        return kueue.slim_workload(items[-1]) if items else None
    return None


def _scrape(body: kopf.Body, job: RLHFJob, cluster: dict[str, Any]) -> dict[str, Any]:
    """The trainer's metrics, read at most once per monitoring.scrapeIntervalSeconds however often the
    reconcile timer fires (JobState.last_scrape), so the status moves at most once per interval."""
    namespace = body.metadata.namespace or "default"
    state = _state(body)
    now = time.monotonic()
    cached = state.last_scrape
    if cached is not None and now - cached[0] < job.spec.monitoring.scrape_interval_seconds:
        return cached[1]
    result: dict[str, Any]
    try:
        url = metrics_url(cluster, job)
        with REMOTE.slot(url):
            result = {"metrics": scrape.fetch_metrics(url, job.name)}
        metrics.SCRAPES.labels("ok").inc()
    except scrape.MetricsUnavailable as e:
        result = {"metrics_error": str(e)}
        metrics.SCRAPES.labels("unavailable").inc()
    except scrape.MalformedMetrics as e:
        log.warning("malformed metrics from %s/%s ignored: %s", namespace, job.name, e)
        result = {"metrics_error": f"malformed metrics: {e}"}
        metrics.SCRAPES.labels("malformed").inc()
    state.last_scrape = (now, result)
    return result


def _patch_in_flight(body: kopf.Body, cluster: dict[str, Any]) -> bool:
    """True while the cluster seen is the version this process last patched: the patch has not come back
    through the watch yet, and sending it again would be a second write of the same change."""
    return _state(body).expect.patch_in_flight((cluster.get("metadata") or {}).get("resourceVersion"))


def _patch_raycluster(
    job_body: kopf.Body, cluster: dict[str, Any], body: Any, content_type: str | None = None
) -> None:
    namespace = job_body.metadata.namespace or "default"
    custom().patch_namespaced_custom_object(
        RAY_GROUP,
        RAY_VERSION,
        namespace,
        RAY_PLURAL,
        cluster["metadata"]["name"],
        body,
        _content_type=content_type,
    )
    version = (cluster.get("metadata") or {}).get("resourceVersion") or ""
    _state(job_body).expect.patched_cluster(version)


def act(body: kopf.Body, job: RLHFJob, observed: Observed, decision: Decision) -> None:
    namespace = body.metadata.namespace or "default"
    cluster = observed.raycluster
    for action in decision.actions:
        if action == "create_cluster":
            _create_cluster(body, job)
        elif action == "submit" and cluster is not None and decision.submission_id:
            failpoints.hit("before_submit")
            url = dashboard_url(cluster)
            with REMOTE.slot(url), _ray_client(url, body) as rj:
                rj.submit(
                    decision.submission_id,
                    manifests.trainer_entrypoint(job),
                    runtime_env=manifests.trainer_runtime_env(job, gpu_standin=CONFIG.gpu_standin),
                    metadata={"rlhfjob": job.name, "namespace": namespace},
                )
            failpoints.hit("after_submit")
        elif action == "stop" and cluster is not None and decision.stop_submission_id:
            _stop_ray_job(cluster, body, decision.stop_submission_id)
        elif action == "snapshot" and cluster is not None and decision.snapshot_submission_id:
            _submit_snapshot(cluster, body, job, decision)
        elif action == "stop_snapshot" and cluster is not None and decision.stop_snapshot_id:
            _stop_ray_job(cluster, body, decision.stop_snapshot_id)
        elif action == "record_stacks" and decision.stacks is not None:
            _record_stacks(body, job, decision)
        elif action == "suspend_cluster" and cluster is not None and not _patch_in_flight(body, cluster):
            _patch_raycluster(body, cluster, {"spec": {"suspend": job.spec.run_policy.suspend}})
        elif action == "delete_cluster" and cluster is not None:
            _state(body).expect.cluster_deleted()
            try:
                custom().delete_namespaced_custom_object(
                    RAY_GROUP, RAY_VERSION, namespace, RAY_PLURAL, cluster["metadata"]["name"]
                )
            except ApiException as e:
                if e.status != 404:
                    raise
        elif action == "delete_job":
            try:
                custom().delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, job.name)
            except ApiException as e:
                if e.status != 404:
                    raise
    for etype, reason, message in decision.events:
        kopf.event(body, type=etype, reason=reason, message=message)
        if reason == "Restarting":
            metrics.RESTARTS.labels(namespace, job.name).inc()
    if decision.new_stall is not None:
        metrics.STALLS.labels(namespace, job.name, decision.new_stall.step_phase_label).inc()


def _submit_snapshot(cluster: dict[str, Any], body: kopf.Body, job: RLHFJob, decision: Decision) -> None:
    """Submit the stall's stack snapshot. A refusal fails the diagnosis, not the round: a restart that
    waits for the snapshot must not wait on a Ray head that will not take it."""
    namespace = body.metadata.namespace or "default"
    url = dashboard_url(cluster)
    try:
        with REMOTE.slot(url), _ray_client(url, body) as rj:
            rj.submit(
                decision.snapshot_submission_id or "",
                diagnosis.entrypoint(job.spec.monitoring.stack_snapshot_timeout_seconds),
                runtime_env=manifests.trainer_runtime_env(job, gpu_standin=CONFIG.gpu_standin),
                metadata={"rlhfjob": job.name, "namespace": namespace, "purpose": "stack-snapshot"},
            )
    except rayjobs.RayJobsError as e:
        why = f"no stack snapshot: submitting it failed: {e}"
        log.warning("%s/%s: %s", namespace, job.name, why)
        decision.status["diagnosis"] = {
            **(decision.status.get("diagnosis") or {}),
            "state": "Failed",
            "summary": why[:1000],
        }
        kopf.event(body, type="Warning", reason="StallDiagnosisFailed", message=why[:1000])


def _stop_ray_job(cluster: dict[str, Any], body: kopf.Body, submission_id: str) -> None:
    """Ask the job's Ray head to stop a Ray job; best effort (a head that cannot be reached is logged)."""
    try:
        url = dashboard_url(cluster)
        with REMOTE.slot(url), _ray_client(url, body) as rj:
            rj.stop(submission_id)
    except rayjobs.RayJobsError as e:
        log.warning("stopping %s: %s", submission_id, e)


def _record_stacks(body: kopf.Body, job: RLHFJob, decision: Decision) -> None:
    """Create or replace the ConfigMap <job>-stacks with the snapshot (owned by the job). A refusal is
    logged and said in an Event, never fatal: the verdict is in the status and the Event already."""
    namespace = body.metadata.namespace or "default"
    conditions: list[dict[str, Any]] = decision.status.get("conditions") or []
    stall = next((str(c.get("message", "")) for c in conditions if c.get("type") == "Stalled"), "")
    owner = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "RLHFJob",
        "name": job.name,
        "uid": body.metadata.uid or "",
        "controller": True,
    }
    cm = diagnosis.config_map(
        job.name, namespace, owner, str(stall), decision.status.get("diagnosis") or {}, decision.stacks or {}
    )
    core = k8s.CoreV1Api(api())
    try:
        try:
            core.create_namespaced_config_map(namespace, cm)  # type: ignore[arg-type]
        except ApiException as e:
            if e.status != 409:
                raise
            core.replace_namespaced_config_map(cm["metadata"]["name"], namespace, cm)  # type: ignore[arg-type]
    except ApiException as e:
        log.warning("writing %s/%s: %s", namespace, cm["metadata"]["name"], _api_message(e))
        kopf.event(body, type="Warning", reason="StallDiagnosisNotKept", message=_api_message(e)[:500])
        return
    if decision.status.get("diagnosis"):
        decision.status["diagnosis"]["configMap"] = cm["metadata"]["name"]


def reconcile_engines(body: kopf.Body, job: RLHFJob, observed: Observed, decision: Decision) -> None:
    """Clamp or autoscale spec.rollout.engines, size the RayCluster's rollout group to it, and report
    rollout workers the cluster cannot place; merges the result into `decision.status`.

    The count lives in spec.rollout.engines only (the scale subresource's field), so `kubectl scale`,
    HPA, KEDA and the built-in policy share one source of truth; the RayCluster follows it every round.
    """
    cluster = observed.raycluster
    if (
        cluster is None
        or decision.status.get("phase") in TERMINAL_JOB_PHASES
        or "delete_cluster" in decision.actions
    ):
        return
    namespace = body.metadata.namespace or "default"
    if kueue.queue_name(job.metadata.get("labels"), cluster) and _kueue_holds_replicas(
        body, cluster, decision, observed.now
    ):
        return
    previous = job.status.model_dump(by_alias=True, exclude_none=True, mode="json") if job.status else {}
    plan = scaling.plan_engines(
        job.spec, previous, decision.status, observed.now, _rollout_pods(namespace, job, cluster)
    )
    if plan.write_spec and not _write_engines(namespace, job.name, plan.requested, plan.engines):
        return  # the request changed under us (another kubectl scale): plan again next round
    decision.status.update(plan.status)
    for etype, reason, message in plan.events:
        kopf.event(body, type=etype, reason=reason, message=message)
    if plan.direction is not None:
        metrics.SCALE_DECISIONS.labels(namespace, job.name, plan.direction).inc()
    if plan.decision is not None and not plan.decision.changed:
        log.debug("%s/%s autoscaler holds: %s", namespace, job.name, plan.decision.message)
    ops = manifests.scale_patch(cluster, manifests.rollout_replicas(job.spec, plan.engines))
    if ops and not _patch_in_flight(body, cluster):
        _patch_raycluster(body, cluster, ops, JSON_PATCH)


def _kueue_holds_replicas(
    body: kopf.Body, cluster: dict[str, Any], decision: Decision, now: datetime
) -> bool:
    """Whether Kueue's management of the RayCluster keeps its replicas as they are (kueue.holds_replicas);
    a fixed-size one is said once, in the EngineScaling condition and an Event."""
    if not kueue.holds_replicas(cluster):
        return False
    if not kueue.suspended_by_kueue(cluster, True):
        engines = (decision.status.get("rollout") or {}).get("desiredEngines")
        conds, said = kueue.fixed_size_condition(decision.status.get("conditions") or [], engines, now)
        decision.status["conditions"] = conds
        if said:
            kopf.event(body, type="Warning", reason="EngineScalingOff", message=said)
    return True


def _cluster_pods(namespace: str, cluster_name: str) -> list[dict[str, Any]]:
    if _pod_index is not None:
        return list(_pod_index.get((namespace, cluster_name), ()))
    pods = k8s.CoreV1Api(api()).list_namespaced_pod(
        namespace, label_selector=f"ray.io/cluster={cluster_name}"
    )
    return [cast(dict[str, Any], api().sanitize_for_serialization(p)) for p in pods.items]  # type: ignore[no-untyped-call]


def _rollout_pods(namespace: str, job: RLHFJob, cluster: dict[str, Any]) -> list[dict[str, Any]]:
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
    pods = k8s.CoreV1Api(api()).list_namespaced_pod(namespace, label_selector=selector)
    return [cast(dict[str, Any], api().sanitize_for_serialization(p)) for p in pods.items]  # type: ignore[no-untyped-call]


def _write_engines(namespace: str, name: str, requested: int, engines: int) -> bool:
    """Set spec.rollout.engines to `engines` if it still is `requested` (JSON-patch test); False if not."""
    ops = [
        {"op": "test", "path": "/spec/rollout/engines", "value": requested},
        {"op": "replace", "path": "/spec/rollout/engines", "value": engines},
    ]
    try:
        custom().patch_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, name, ops, _content_type=JSON_PATCH
        )
    except ApiException as e:
        if e.status in (409, 422):  # test failed (changed meanwhile) or admission refused it
            log.warning(
                "%s/%s: not setting rollout.engines %s→%s: %s", namespace, name, requested, engines, e.body
            )
            return False
        raise
    return True


def _first_round_delay(**_: Any) -> float:
    return throttle.first_delay(CONFIG.reconcile_interval)


@kopf.timer(
    GROUP, VERSION, PLURAL, interval=CONFIG.reconcile_interval, initial_delay=_first_round_delay, sharp=False
)
def reconcile(
    body: kopf.Body,
    patch: kopf.Patch,
    rayclusters: kopf.Index[tuple[str, str], dict[str, Any]] | None = None,
    rlhf_pods: kopf.Index[tuple[str, str], dict[str, Any]] | None = None,
    **_: Any,
) -> None:
    """The level-triggered loop: observe, decide, act, and patch only what changed."""
    _use_index(rayclusters, rlhf_pods)
    started = time.monotonic()
    namespace = body.metadata.namespace or "default"
    job = _parse(body)
    if isinstance(job, str):
        _invalid(body, patch, job)
        return
    if _awaiting_own_write(body):
        return  # this body predates our last write (or the create handler's first): next round
    try:
        attempt = int(body.status.get("restarts") or 0)
        preemptions = int(body.status.get("preemptions") or 0)
        submission = manifests.submission_id(job, body.metadata.uid or "", attempt, preemptions)
        observed = observe(body, job, submission)
        decision = decide(job, observed, submission)
        # Before acting: a stall's series exists before the stuck attempt is stopped, so the stall alert
        # goes on from the trainer's own series to it without a gap (docs/monitoring.md).
        metrics.record_open_stall(namespace, job.name, decision.status.get("openStall"))
        if decision.status.get("phase") == "Restarting" and body.status.get("phase") != "Restarting":
            failpoints.hit("after_restart_decision")
        if "create_cluster" in decision.actions and _create_backing_off(body):
            return  # a transient refusal's backoff: the status already says why
        try:
            act(body, job, observed, decision)
        except ClusterRefused as refusal:
            _refused(body, patch, job, refusal)
            return
        reconcile_engines(body, job, observed, decision)
        failpoints.hit("before_status_patch")
    except (ApiException, rayjobs.RayJobsError) as e:
        metrics.RECONCILE_ERRORS.labels(namespace, type(e).__name__).inc()
        raise kopf.TemporaryError(f"reconcile: {e}", delay=2) from e
    current = _clean_status(dict(body.status)) or {}
    changes = status_patch(current, decision.status)
    for key, value in changes.items():
        patch.status[key] = value
    _remember_write(body.metadata.uid or "", changes)
    metrics.record_job_phase(namespace, job.name, decision.status.get("phase"))
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
    namespace, name, uid = (
        body.metadata.namespace or "default",
        body.metadata.name or "",
        body.metadata.uid or "",
    )
    metrics.record_job_phase(namespace, name, None)
    metrics.record_open_stall(namespace, name, None)
    sid = body.status.get("submissionId")
    try:
        if sid and CONFIG.dev_head_host and sid not in _stopped:
            _stopped[sid] = None
            while len(_stopped) > _STOPPED_KEPT:
                del _stopped[next(iter(_stopped))]
            with (
                REMOTE.slot(dashboard_url(None)),
                _ray_client(dashboard_url(None), body) as rj,
            ):
                rj.stop(sid)
    except rayjobs.RayJobsError as e:
        log.warning("could not stop %s: %s", sid, e)
    finally:
        state = JOBS.forget(uid)
        for client in state.ray_clients.values() if state is not None else ():
            client.close()
