"""What a reconcile round observes besides the cache: the job's Ray job through the Jobs API (one client per
job and head, kept in its state), the trainer's /metrics at most once per scrape interval (its client kept
too), the stall's stack snapshot, and Kueue's Workload.

Reads only, each remote call in a slot of the limiter (runtime.REMOTE).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any, cast

import kopf
from kubernetes.client.exceptions import ApiException
from rlhf_api.model_source import FETCH_CONTAINER
from rlhf_api.spec import TERMINAL_JOB_PHASES, RLHFJob

from rlhf_operator import (
    cache,
    diagnosis,
    kube,
    kueue,
    manifests,
    metrics,
    model_fetch,
    rayjobs,
    runtime,
    scrape,
    security,
)
from rlhf_operator.status import Observed

log = logging.getLogger("rlhf_operator")


def ray_token(body: kopf.Body) -> str:
    """The job's Ray token, sent on every Jobs API call (a head without token authentication ignores it)."""
    meta = body.metadata
    return security.job_token(
        rayjobs.token_key(), meta.namespace or "default", meta.name or "", meta.uid or ""
    )


@contextlib.contextmanager
def ray_client(url: str, body: kopf.Body) -> Iterator[rayjobs.RayJobsClient]:
    """The job's Jobs API client for this head, kept between rounds (JobState.ray_clients): its connection
    stays open, where a client per round paid for a new client and a TCP connection every round of every
    job."""
    clients = runtime.state_of(body).ray_clients
    client = clients.get(url)
    if client is None:
        client = clients[url] = rayjobs.RayJobsClient(
            url, token=ray_token(body), keepalive=runtime.CONFIG.head_keepalive
        )
    try:
        yield client
    except rayjobs.RayJobsError:
        clients.pop(url, None)  # a fresh client (and connection) next time
        client.close()
        raise


def dashboard_url(cluster: dict[str, Any] | None) -> str:
    """The Ray dashboard (Jobs API) of a RayCluster's head, or of the development head."""
    port = runtime.CONFIG.dev_dashboard_port if runtime.CONFIG.dev_head_host else manifests.DASHBOARD_PORT
    return manifests.head_url(cluster, port, runtime.CONFIG.dev_head_host)


def metrics_url(cluster: dict[str, Any], job: RLHFJob) -> str:
    """The trainer's /metrics, served by the driver on the head."""
    return (
        manifests.head_url(cluster, job.spec.monitoring.metrics_port, runtime.CONFIG.dev_head_host)
        + "/metrics"
    )


def observe(body: kopf.Body, job: RLHFJob, submission: str) -> Observed:
    """Everything `status.decide` needs besides the job: the RayCluster, its pods, the Ray job, the scrape,
    the snapshot, Kueue's Workload, the engine plan's rollout pods and the expectations' holds."""
    namespace = body.metadata.namespace or "default"
    cluster = cache.get_cluster(body, manifests.raycluster_name(job.name))
    obs: dict[str, Any] = {
        "now": datetime.now(UTC),
        "uid": body.metadata.uid or "",
        "raycluster": cluster,
        "create_backoff": cluster is None and cache.create_backing_off(body),
    }
    queue = kueue.queue_name(job.metadata.get("labels"), cluster)
    if cluster is not None and kueue.suspended_by_kueue(cluster, queue is not None):
        obs["workload"] = _workload(namespace, cluster)
        return Observed(**obs)  # nothing runs: no Jobs API, no scrape, no pods to read
    if cluster is not None:
        obs["cluster_patch_pending"] = cache.patch_in_flight(body, cluster)
        if body.status.get("phase") not in TERMINAL_JOB_PHASES and not (
            queue and kueue.holds_replicas(cluster)
        ):
            obs["rollout_pods"] = cache.rollout_pods(namespace, job, cluster)  # the engine plan's
    if cluster is not None and (
        cluster.get("status", {}).get("state") != "ready" or _models_unconfirmed(body, job)
    ):
        obs["pods"] = cache.cluster_pods(namespace, cluster["metadata"]["name"])
        obs["fetch_log"] = _fetch_log(namespace, obs["pods"])
    if cluster is not None and cluster.get("status", {}).get("state") == "ready":
        obs.update(ray_job_and_metrics(body, job, cluster, body.status.get("submissionId") or submission))
        taking = body.status.get("diagnosis") or {}
        if taking.get("state") == "Taking" and obs.get("ray_job_error") is None:
            obs["stacks"] = _snapshot_result(cluster, body, str(taking.get("submissionId")))
    return Observed(**obs)


def ray_job_and_metrics(body: kopf.Body, job: RLHFJob, cluster: dict[str, Any], sid: str) -> dict[str, Any]:
    """The Ray job (Jobs API) and, while it runs, the trainer's metrics. A job whose Ray job was RUNNING at
    the last read and whose trainer answers a scrape due now with this job's series is still RUNNING (its
    driver serves /metrics, and Ray ends the job only after the driver exits): that round skips the Jobs
    API read, half of a running job's calls to its head."""
    state = runtime.state_of(body)
    known = state.running_job
    if known is not None and known.submission_id == sid and scrape_due(body, job):
        scraped = trainer_metrics(body, job, cluster)
        m = scraped.get("metrics")
        if m is not None and (m.total_steps is not None or m.driver_started_ts is not None):
            return {"ray_job": known, **scraped}
    out: dict[str, Any] = {}
    try:
        url = dashboard_url(cluster)
        with runtime.REMOTE.slot(url), ray_client(url, body) as rj:
            out["ray_job"] = rj.get(sid)
            if out["ray_job"] is None:  # about to submit: is the attempt before still stopping?
                out["previous_running"] = _previous_running(rj, body, job)
    except rayjobs.RayJobsError as e:
        out["ray_job_error"] = str(e)
    running = out.get("ray_job") is not None and out["ray_job"].status == rayjobs.RUNNING
    state.running_job = out["ray_job"] if running else None
    if running:
        out.update(trainer_metrics(body, job, cluster))
    return out


def _snapshot_result(cluster: dict[str, Any], body: kopf.Body, sid: str) -> diagnosis.SnapshotResult | None:
    """The stall's snapshot job: running (not done), or ended with the snapshot its log ends with."""
    url = dashboard_url(cluster)
    try:
        with runtime.REMOTE.slot(url), ray_client(url, body) as rj:
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
            found = kube.custom().list_namespaced_custom_object(
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
                log.warning("cannot read Kueue Workloads in %s: %s", namespace, kube.api_message(e))
                return None
            raise
        listed: list[dict[str, Any]] = cast(dict[str, Any], found).get("items") or []
        items = sorted(listed, key=lambda w: (w.get("metadata") or {}).get("creationTimestamp") or "")
        return kueue.slim_workload(items[-1]) if items else None
    return None


def scrape_due(body: kopf.Body, job: RLHFJob) -> bool:
    """Whether monitoring.scrapeIntervalSeconds has passed since the job's last scrape (or none was made)."""
    cached = runtime.state_of(body).last_scrape
    return cached is None or time.monotonic() - cached[0] >= job.spec.monitoring.scrape_interval_seconds


def trainer_metrics(body: kopf.Body, job: RLHFJob, cluster: dict[str, Any]) -> dict[str, Any]:
    """The trainer's metrics, read at most once per monitoring.scrapeIntervalSeconds however often the
    reconcile timer fires (JobState.last_scrape), so the status moves at most once per interval."""
    namespace = body.metadata.namespace or "default"
    state = runtime.state_of(body)
    now = time.monotonic()
    cached = state.last_scrape
    if cached is not None and not scrape_due(body, job):
        return cached[1]
    result: dict[str, Any]
    try:
        url = metrics_url(cluster, job)
        http = state.scrape_client = state.scrape_client or scrape.client(runtime.CONFIG.head_keepalive)
        with runtime.REMOTE.slot(url):
            result = {"metrics": scrape.fetch_metrics(url, job.name, http)}
        metrics.SCRAPES.labels("ok").inc()
    except scrape.MetricsUnavailable as e:
        state.close_scrape()  # a fresh connection next time (a new head, a restarted driver)
        result = {"metrics_error": str(e)}
        metrics.SCRAPES.labels("unavailable").inc()
    except scrape.MalformedMetrics as e:
        log.warning("malformed metrics from %s/%s ignored: %s", namespace, job.name, e)
        result = {"metrics_error": f"malformed metrics: {e}"}
        metrics.SCRAPES.labels("malformed").inc()
    state.last_scrape = (now, result)
    return result


def _models_unconfirmed(body: kopf.Body, job: RLHFJob) -> bool:
    """Remote models whose ModelsReady is not True yet: the head pod's finished fetch step (its bytes) is
    read once more after the cluster is ready, in case it finished between two rounds."""
    conditions = body.status.get("conditions") or []
    confirmed = any(c.get("type") == "ModelsReady" and c.get("status") == "True" for c in conditions)
    return not confirmed and bool(manifests.remote_models(job.spec))


def _fetch_log(namespace: str, pods: list[dict[str, Any]]) -> str | None:
    """The last lines of the head's fetch-models log while it runs (its progress for ModelsReady); None
    when no fetch runs or the log cannot be read (the condition then shows no bytes this round)."""
    pod = model_fetch.fetching_pod(pods)
    if pod is None:
        return None
    try:
        return cache.container_log_tail(namespace, pod, FETCH_CONTAINER, lines=5)
    except ApiException as e:
        log.debug("cannot read %s/%s's fetch log: %s", namespace, pod, e.reason)
        return None
