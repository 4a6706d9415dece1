"""A round's actions: carry out the `status.decide` decision (create, submit, stop, snapshot, suspend, delete),
emit its Events, and size the rollout group to the engine plan (`scaling.plan_engines`).

What to do is decided elsewhere (status, scaling, kueue); this module only does it.
"""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any

import kopf
from kubernetes.client.exceptions import ApiException
from rlhf_api.spec import GROUP, PLURAL, TERMINAL_JOB_PHASES, VERSION, RLHFJob

from rlhf_operator import (
    cache,
    children,
    diagnosis,
    failpoints,
    kube,
    kueue,
    manifests,
    metrics,
    observe,
    rayjobs,
    runtime,
    scaling,
)
from rlhf_operator.status import Decision, Observed

log = logging.getLogger("rlhf_operator")


def act(body: kopf.Body, job: RLHFJob, observed: Observed, decision: Decision) -> None:
    namespace = body.metadata.namespace or "default"
    cluster = observed.raycluster
    for action in decision.actions:
        if action == "create_cluster":
            children.create_cluster(body, job)
        elif action == "submit" and cluster is not None and decision.submission_id:
            failpoints.hit("before_submit")
            url = observe.dashboard_url(cluster)
            with runtime.REMOTE.slot(url), observe.ray_client(url, body) as rj:
                rj.submit(
                    decision.submission_id,
                    manifests.trainer_entrypoint(job),
                    runtime_env=manifests.trainer_runtime_env(job, gpu_standin=runtime.CONFIG.gpu_standin),
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
            children.record_stacks(body, job, decision)
        elif action == "suspend_cluster" and cluster is not None and not cache.patch_in_flight(body, cluster):
            children.patch_raycluster(body, cluster, {"spec": {"suspend": job.spec.run_policy.suspend}})
        elif action == "delete_cluster" and cluster is not None:
            runtime.state_of(body).expect.cluster_deleted()
            try:
                kube.custom().delete_namespaced_custom_object(
                    kube.RAY_GROUP, kube.RAY_VERSION, namespace, kube.RAY_PLURAL, cluster["metadata"]["name"]
                )
            except ApiException as e:
                if e.status != 404:
                    raise
        elif action == "delete_job":
            try:
                kube.custom().delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, job.name)
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
    url = observe.dashboard_url(cluster)
    try:
        with runtime.REMOTE.slot(url), observe.ray_client(url, body) as rj:
            rj.submit(
                decision.snapshot_submission_id or "",
                diagnosis.entrypoint(job.spec.monitoring.stack_snapshot_timeout_seconds),
                runtime_env=manifests.trainer_runtime_env(job, gpu_standin=runtime.CONFIG.gpu_standin),
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
        url = observe.dashboard_url(cluster)
        with runtime.REMOTE.slot(url), observe.ray_client(url, body) as rj:
            rj.stop(submission_id)
    except rayjobs.RayJobsError as e:
        log.warning("stopping %s: %s", submission_id, e)


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
        job.spec, previous, decision.status, observed.now, cache.rollout_pods(namespace, job, cluster)
    )
    if plan.write_spec and not children.write_engines(namespace, job.name, plan.requested, plan.engines):
        return  # the request changed under us (another kubectl scale): plan again next round
    decision.status.update(plan.status)
    for etype, reason, message in plan.events:
        kopf.event(body, type=etype, reason=reason, message=message)
    if plan.direction is not None:
        metrics.SCALE_DECISIONS.labels(namespace, job.name, plan.direction).inc()
    if plan.decision is not None and not plan.decision.changed:
        log.debug("%s/%s autoscaler holds: %s", namespace, job.name, plan.decision.message)
    ops = manifests.scale_patch(cluster, manifests.rollout_replicas(job.spec, plan.engines))
    if ops and not cache.patch_in_flight(body, cluster):
        children.patch_raycluster(body, cluster, ops, kube.JSON_PATCH)


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
