"""A round's actions: carry out the typed actions of the `status.decide` decision (create, submit, stop,
snapshot, suspend, scale, delete) in order, and emit its Events.

What to do is decided elsewhere (status, with scaling's engine plan and kueue's hold as its inputs); this
module only does it, and vetoes nothing.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import kopf
from kubernetes.client.exceptions import ApiException
from rlhf_api.spec import GROUP, PLURAL, VERSION, RLHFJob

from rlhf_operator import children, diagnosis, failpoints, kube, manifests, metrics, observe, rayjobs, runtime
from rlhf_operator.actions import (
    Action,
    CreateCluster,
    Decision,
    DeleteCluster,
    DeleteJob,
    RecordStacks,
    ScaleRolloutGroup,
    SetClusterSuspend,
    StopRayJob,
    StopSnapshot,
    SubmitSnapshot,
    SubmitTrainer,
    WriteEngines,
)
from rlhf_operator.status import Observed

log = logging.getLogger("rlhf_operator")


class Replan(Exception):
    """spec.rollout.engines changed under the round (another `kubectl scale`): nothing more is done or
    written this round, and the next one plans again from the new request."""


def act(body: kopf.Body, job: RLHFJob, observed: Observed, decision: Decision) -> dict[str, Any]:
    """Carry out the decision's actions in order, then emit its Events; the status to write back: the
    decision's, with what the I/O itself learned (a snapshot that could not be submitted, the ConfigMap
    that holds one)."""
    status = copy.deepcopy(decision.status)
    for action in decision.actions:
        _do(body, job, observed.raycluster, action, status)
    namespace = body.metadata.namespace or "default"
    for etype, reason, message in decision.events:
        kopf.event(body, type=etype, reason=reason, message=message)
        if reason == "Restarting":
            metrics.RESTARTS.labels(namespace, job.name).inc()
    if decision.new_stall is not None:
        metrics.STALLS.labels(namespace, job.name, decision.new_stall.step_phase_label).inc()
    return status


def _do(
    body: kopf.Body, job: RLHFJob, cluster: dict[str, Any] | None, action: Action, status: dict[str, Any]
) -> None:
    namespace = body.metadata.namespace or "default"
    match action:
        case CreateCluster():
            children.create_cluster(body, job)
        case WriteEngines(requested=requested, engines=engines, direction=direction):
            if not children.write_engines(namespace, job.name, requested, engines):
                raise Replan(f"spec.rollout.engines is no longer {requested}")
            if direction is not None:
                metrics.SCALE_DECISIONS.labels(namespace, job.name, direction).inc()
        case DeleteJob():
            try:
                kube.custom().delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, job.name)
            except ApiException as e:
                if e.status != 404:
                    raise
        case RecordStacks(stacks=stacks):
            children.record_stacks(body, job, status, stacks)
        case _ if cluster is not None:
            _on_cluster(body, job, cluster, action, status)


def _on_cluster(
    body: kopf.Body, job: RLHFJob, cluster: dict[str, Any], action: Action, status: dict[str, Any]
) -> None:
    """The actions on the job's RayCluster and its Ray head."""
    match action:
        case SubmitTrainer(submission_id=sid):
            failpoints.hit("before_submit")
            url = observe.dashboard_url(cluster)
            with runtime.REMOTE.slot(url), observe.ray_client(url, body) as rj:
                rj.submit(
                    sid,
                    manifests.trainer_entrypoint(job),
                    runtime_env=manifests.trainer_runtime_env(
                        job,
                        gpu_standin=runtime.CONFIG.gpu_standin,
                        pod_slots=not runtime.CONFIG.dev_head_host,
                    ),
                    metadata={"rlhfjob": job.name, "namespace": body.metadata.namespace or "default"},
                )
            failpoints.hit("after_submit")
        case StopRayJob(submission_id=sid) | StopSnapshot(submission_id=sid):
            _stop_ray_job(cluster, body, sid)
        case SubmitSnapshot(submission_id=sid):
            _submit_snapshot(cluster, body, job, sid, status)
        case SetClusterSuspend(suspend=suspend):
            children.patch_raycluster(body, cluster, {"spec": {"suspend": suspend}})
        case ScaleRolloutGroup(ops=ops):
            children.patch_raycluster(body, cluster, list(ops), kube.JSON_PATCH)
        case DeleteCluster():
            runtime.state_of(body).expect.cluster_deleted()
            namespace, name = body.metadata.namespace or "default", cluster["metadata"]["name"]
            try:
                kube.custom().delete_namespaced_custom_object(
                    kube.RAY_GROUP, kube.RAY_VERSION, namespace, kube.RAY_PLURAL, name
                )
            except ApiException as e:
                if e.status != 404:
                    raise


def _submit_snapshot(
    cluster: dict[str, Any], body: kopf.Body, job: RLHFJob, sid: str, status: dict[str, Any]
) -> None:
    """Submit the stall's stack snapshot. A refusal fails the diagnosis, not the round: a restart that
    waits for the snapshot must not wait on a Ray head that will not take it."""
    namespace = body.metadata.namespace or "default"
    url = observe.dashboard_url(cluster)
    try:
        with runtime.REMOTE.slot(url), observe.ray_client(url, body) as rj:
            rj.submit(
                sid,
                diagnosis.entrypoint(job.spec.monitoring.stack_snapshot_timeout_seconds),
                runtime_env=manifests.trainer_runtime_env(
                    job, gpu_standin=runtime.CONFIG.gpu_standin, pod_slots=not runtime.CONFIG.dev_head_host
                ),
                metadata={"rlhfjob": job.name, "namespace": namespace, "purpose": "stack-snapshot"},
            )
    except rayjobs.RayJobsError as e:
        why = f"no stack snapshot: submitting it failed: {e}"
        log.warning("%s/%s: %s", namespace, job.name, why)
        status["diagnosis"] = {
            **(status.get("diagnosis") or {}),
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
