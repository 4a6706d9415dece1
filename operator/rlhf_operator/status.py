"""(RayCluster, Ray job, scraped metrics, clock) -> the RLHFJob's next status and the actions to take.

Pure: no Kubernetes, Ray or HTTP calls. The handler observes the world, calls `decide`, applies the
actions it returns and patches the status diff. Everything here is level-triggered and idempotent, so
an operator killed at any point converges to the same answer on restart.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

from rlhf_api.constants import INPUT_ERROR_EXIT_CODE
from rlhf_api.spec import RLHFJob

from rlhf_operator import diagnosis, kueue, rayjobs
from rlhf_operator.conditions import iso, parse_time, set_condition
from rlhf_operator.fabric import asks_rdma, fabric_condition
from rlhf_operator.manifests import JOB_LABEL, ROLE_LABEL, effective_engines, raycluster_name
from rlhf_operator.pod_problems import diagnose, rejection_is_permanent
from rlhf_operator.scrape import ScrapedMetrics
from rlhf_operator.stall import Stall, detect_stall, set_stalled_condition

Action = Literal[
    "create_cluster",  # the RayCluster is missing
    "submit",  # submit the trainer as Ray job `submission_id`
    "stop",  # stop Ray job `stop_submission_id`
    "suspend_cluster",  # set RayCluster spec.suspend to the job's runPolicy.suspend
    "delete_cluster",  # the job finished: release the RayCluster's GPUs
    "delete_job",  # ttlSecondsAfterFinished elapsed
    "snapshot",  # submit the stall's stack snapshot as Ray job `snapshot_submission_id`
    "stop_snapshot",  # stop the snapshot's Ray job (past its time limit)
    "record_stacks",  # write `stacks` into the ConfigMap <job>-stacks
]


def input_error(job_info: rayjobs.RayJobInfo) -> str | None:
    """The driver's own `error:` line when it failed on bad input (exit INPUT_ERROR_EXIT_CODE), else None.

    Such a failure is permanent (a model path that does not exist, a reward function that does not
    import, another run's checkpoint): restarting would fail the same way, so the job fails at once and
    keeps its backoffLimit for failures a restart can cure. Ray's message ends with the log's tail; the
    driver's last line there is `error: <what and where>`.
    """
    if job_info.status != rayjobs.FAILED or job_info.driver_exit_code != INPUT_ERROR_EXIT_CODE:
        return None
    lines = [ln.strip() for ln in job_info.message.splitlines()]
    at = [i for i, ln in enumerate(lines) if ln.startswith("error:")]
    if not at:
        return job_info.message.strip()[-300:] or f"exit {INPUT_ERROR_EXIT_CODE}"
    said = "\n".join(ln for ln in lines[at[-1] :] if ln).removeprefix("error:").strip()
    return said if len(said) <= 1000 else said[:1000] + " ..."  # a multi-line InputError: every issue


@dataclass(frozen=True)
class Observed:
    """What the handler saw this round. None means "not found"; errors are strings with the reason."""

    now: datetime
    uid: str
    raycluster: dict[str, Any] | None
    ray_job: rayjobs.RayJobInfo | None = None
    ray_job_error: str | None = None
    metrics: ScrapedMetrics | None = None
    metrics_error: str | None = None
    pods: list[dict[str, Any]] | None = None  # the RayCluster's pods, read while it is not ready
    workload: dict[str, Any] | None = None  # Kueue's Workload of a queued RayCluster (kueue.slim_workload)
    # The previous attempt's Ray job, still stopping (it finishes its step and may save a checkpoint)
    # when the next one is due: its id. The next is submitted only once it has ended.
    previous_running: str | None = None
    # The stall's snapshot job, read while status.diagnosis is Taking.
    stacks: diagnosis.SnapshotResult | None = None


@dataclass
class Decision:
    status: dict[str, Any]
    actions: list[Action] = field(default_factory=list)
    submission_id: str | None = None
    stop_submission_id: str | None = None
    events: list[tuple[str, str, str]] = field(default_factory=list)  # (type, reason, message)
    new_stall: Stall | None = None  # a stall first seen (or first attributed to a step phase) this round
    snapshot_submission_id: str | None = None
    stop_snapshot_id: str | None = None
    stacks: dict[str, Any] | None = None  # the snapshot to keep in the ConfigMap (record_stacks)

    def event(self, reason: str, message: str, warning: bool = False) -> None:
        self.events.append(("Warning" if warning else "Normal", reason, message))


def cluster_ready(raycluster: dict[str, Any] | None) -> bool:
    return bool(raycluster) and (raycluster or {}).get("status", {}).get("state") == "ready"


def head_pod_name(raycluster: dict[str, Any] | None) -> str | None:
    """The head pod KubeRay reports for the cluster now (status.head.podName), if any."""
    return ((raycluster or {}).get("status", {}).get("head") or {}).get("podName") or None


def head_lost(raycluster: dict[str, Any] | None, attempt_head: str | None) -> str | None:
    """Why the current attempt's head pod is gone, or None. KubeRay keeps a RayCluster's state `ready`
    after its first start, so a replaced head pod shows only here (kuberay#2161: a RayJob left Running)."""
    if not attempt_head:
        return None
    now = head_pod_name(raycluster)
    if now is None:
        return f"the Ray head pod {attempt_head} is gone"
    if now != attempt_head:
        return f"the Ray head pod {attempt_head} was replaced by {now}"
    return None


def cluster_problem(raycluster: dict[str, Any] | None) -> str | None:
    """KubeRay's own failure report, if any (e.g. pods failing to be created)."""
    if not raycluster:
        return None
    st = raycluster.get("status", {})
    if st.get("state") == "failed":
        return str(st.get("reason") or st.get("message") or "RayCluster failed")
    for c in st.get("conditions", []) or []:
        if c.get("type") == "ReplicaFailure" and c.get("status") == "True":
            return f"{c.get('reason')}: {c.get('message')}"
    return None


def decide(job: RLHFJob, observed: Observed, submission_id: str) -> Decision:
    """The next status and actions. `submission_id` is the id of the current attempt (from restarts)."""
    spec = job.spec
    cur: dict[str, Any] = (
        job.status.model_dump(by_alias=True, exclude_none=True, mode="json") if job.status else {}
    )
    now = observed.now
    job_phase = cur.get("phase") or "Pending"
    st: dict[str, Any] = dict(cur)
    conds: list[dict[str, Any]] = list(cur.get("conditions", []))
    d = Decision(status=st)
    generation = int(job.metadata.get("generation") or 0) or None
    st["observedGeneration"] = generation
    st["totalSteps"] = spec.algorithm.total_steps
    st.setdefault("restarts", 0)
    if observed.raycluster:
        st["rayClusterName"] = observed.raycluster["metadata"]["name"]
    st.setdefault("progress", f"{st.get('step', 0)}/{spec.algorithm.total_steps}")
    rollout = dict(st.get("rollout") or {})
    rollout["desiredEngines"] = effective_engines(spec)
    rollout["selector"] = f"{JOB_LABEL}={job.name},{ROLE_LABEL}=rollout"
    st["rollout"] = rollout

    def go(new_job_phase: str, message: str, reason: str | None = None, warning: bool = False) -> None:
        if new_job_phase != job_phase:
            d.event(reason or new_job_phase, message, warning=warning)
        st["phase"] = new_job_phase
        st["message"] = message

    # Finished jobs stay finished; only the TTL clock and the cluster's release remain.
    if job_phase in ("Succeeded", "Failed"):
        if observed.raycluster:
            d.actions.append("delete_cluster")
        ttl = spec.run_policy.ttl_seconds_after_finished
        done = parse_time(cur.get("completionTime"))
        if ttl is not None and done and (now - done).total_seconds() >= ttl:
            d.actions.append("delete_job")
        st["conditions"] = conds
        return d

    def finish(new_job_phase: str, reason: str, message: str) -> Decision:
        go(new_job_phase, message, reason, warning=new_job_phase == "Failed")
        st["completionTime"] = iso(now)
        st.pop("openStall", None)  # a finished job has no stall to resolve
        nonlocal conds
        conds = set_condition(
            conds, "Succeeded" if new_job_phase == "Succeeded" else "Failed", True, reason, message, now
        )
        conds = set_condition(conds, "Running", False, reason, message, now)
        st["conditions"] = conds
        if observed.ray_job and observed.ray_job.status not in rayjobs.TERMINAL:
            d.actions.append("stop")
            d.stop_submission_id = observed.ray_job.submission_id
        if observed.raycluster:
            d.actions.append("delete_cluster")
        return d

    # Kueue manages the RayCluster of a job with a queue label: its spec.suspend is Kueue's alone.
    queue = kueue.queue_name(job.metadata.get("labels"), observed.raycluster)

    # Suspend: keep the CR, release the pods, stop the trainer; resume from checkpoint.
    if spec.run_policy.suspend:
        if observed.raycluster and queue:
            d.actions.append("delete_cluster")  # releases Kueue's quota with it; recreated (queued) on resume
        elif observed.raycluster and not observed.raycluster.get("spec", {}).get("suspend"):
            d.actions.append("suspend_cluster")
        if observed.ray_job and observed.ray_job.status not in rayjobs.TERMINAL:
            d.actions.append("stop")
            d.stop_submission_id = observed.ray_job.submission_id
        st.pop("activeSince", None)  # the deadline clock starts again on resume, as for a Kubernetes Job
        go("Suspended", "runPolicy.suspend is true: pods released, resumes from the last checkpoint")
        st["conditions"] = set_condition(
            conds, "Suspended", True, "Suspended", "suspended by runPolicy.suspend", now
        )
        return d
    if queue and kueue.suspended_by_kueue(observed.raycluster, True):
        return _queued(d, job_phase, conds, queue, observed, go)
    if observed.raycluster and observed.raycluster.get("spec", {}).get("suspend"):
        d.actions.append("suspend_cluster")  # un-suspend: the handler sets it to runPolicy.suspend (false)
    conds = (
        set_condition(conds, "Suspended", False, "NotSuspended", "", now)
        if any(c.get("type") == "Suspended" for c in conds)
        else conds
    )
    if queue and any(c.get("type") == "Queued" and c.get("status") == "True" for c in conds):
        conds = set_condition(conds, "Queued", False, "Admitted", f"admitted by Kueue from {queue}", now)
    if job_phase == "Queued":  # admitted: the deadline counts from now, as after an unsuspension
        st["activeSince"] = iso(now)
        go("Provisioning", f"admitted by Kueue from LocalQueue {queue}: starting the RayCluster", "Admitted")
        job_phase = "Provisioning"

    # Active deadline, counted like a Kubernetes Job's: from the job's creation, or its last unsuspension,
    # so time stuck provisioning counts too.
    started = parse_time(cur.get("startTime"))
    # A new job: its creation; a resumed one: now; one from before this field: its start.
    if "activeSince" not in st:
        created = parse_time(job.metadata.get("creationTimestamp"))
        since = created if job_phase == "Pending" else now if job_phase == "Suspended" else started
        st["activeSince"] = iso(since or now)
    active_since = parse_time(st["activeSince"]) or now
    deadline = spec.run_policy.active_deadline_seconds
    if deadline is not None and (now - active_since).total_seconds() > deadline:
        where = "" if job_phase in ("Running", "Stalled") else f" ({st.get('message') or job_phase})"
        return finish(
            "Failed",
            "DeadlineExceeded",
            f"active longer than runPolicy.activeDeadlineSeconds={deadline}{where}",
        )

    def restart_or_fail(reason: str, limit_reason: str) -> Decision:
        restarts = int(st.get("restarts") or 0)
        if restarts < spec.run_policy.backoff_limit:
            st["restarts"] = restarts + 1
            st["lastRestartTime"] = iso(now)
            st.pop("submissionId", None)
            go(
                "Restarting",
                f"{reason}; restart {restarts + 1}/{spec.run_policy.backoff_limit} from the last checkpoint",
                "Restarting",
                warning=True,
            )
            st["conditions"] = set_condition(conds, "Running", False, "Restarting", reason, now)
            return d
        return finish(
            "Failed", limit_reason, f"{reason}; backoffLimit {spec.run_policy.backoff_limit} reached"
        )

    # Provisioning timeout: this attempt has not reached a running trainer in time.
    timeout = spec.run_policy.provisioning_timeout_seconds
    attempt_start = max(t for t in (active_since, parse_time(cur.get("lastRestartTime"))) if t is not None)
    if (
        timeout is not None
        and job_phase in ("Pending", "Provisioning", "Restarting")
        and (now - attempt_start).total_seconds() > timeout
    ):
        why = f"not running after runPolicy.provisioningTimeoutSeconds={timeout}: {st.get('message') or job_phase}"
        if spec.run_policy.on_provisioning_timeout == "Restart":
            if observed.raycluster:
                d.actions.append("delete_cluster")  # new pods, perhaps on other nodes
            return restart_or_fail(why, "ProvisioningTimeout")
        return finish("Failed", "ProvisioningTimeout", why)

    if observed.raycluster is None:
        st.pop("headPod", None)  # the next attempt's head is the new cluster's
        d.actions.append("create_cluster")
        if job_phase == "Suspended":
            go(
                "Pending",
                "resumed: creating the RayCluster; the trainer resumes from its checkpoint",
                "Resumed",
            )
        elif job_phase not in ("Pending", "Restarting"):
            go(
                "Provisioning",
                "RayCluster missing: recreating it; the trainer resumes from its checkpoint",
                "ClusterRecreated",
                warning=True,
            )
        else:
            go("Pending" if job_phase == "Pending" else job_phase, "creating the RayCluster")
        st["conditions"] = conds
        return d

    # The head pod of a running attempt replaced or gone: its driver and the GCS went with it, whatever
    # the RayCluster's state says. Restart from the last checkpoint rather than stay Running on nothing.
    lost = head_lost(observed.raycluster, cur.get("headPod")) if job_phase in ("Running", "Stalled") else None
    if lost:
        st.pop("headPod", None)
        return restart_or_fail(
            f"{lost}: the trainer's driver and the GCS went with it", "BackoffLimitExceeded"
        )

    problem = cluster_problem(observed.raycluster)
    if not cluster_ready(observed.raycluster):
        msg = f"waiting for RayCluster {st['rayClusterName']} to be ready"
        pod_problem = diagnose(observed.pods or [])
        if problem:
            msg = f"RayCluster {st['rayClusterName']} is not ready: {problem}"
        elif pod_problem:
            msg = f"RayCluster {st['rayClusterName']} is not ready: {pod_problem.describe()}"
        conds = set_condition(conds, "ClusterReady", False, "ClusterNotReady", msg, now)
        before = next((c for c in conds if c.get("type") == "PodsReady"), None)
        if pod_problem:
            if not before or before.get("status") != "False" or before.get("reason") != pod_problem.reason:
                d.event(pod_problem.reason, pod_problem.describe(), warning=True)  # once per new reason
            conds = set_condition(conds, "PodsReady", False, pod_problem.reason, pod_problem.describe(), now)
        elif before is not None and before.get("status") == "False":
            conds = set_condition(conds, "PodsReady", True, "PodsScheduled", "no pod problem found", now)
        st["conditions"] = conds
        if job_phase in ("Pending", "Provisioning", "Restarting"):
            go("Provisioning" if job_phase != "Restarting" else "Restarting", msg)
        return d
    conds = set_condition(conds, "ClusterReady", True, "ClusterReady", "RayCluster is ready", now)

    job_info = observed.ray_job
    if observed.ray_job_error and job_info is None:
        conds = set_condition(
            conds, "JobSubmitted", False, "RayDashboardUnavailable", observed.ray_job_error, now
        )
        st["conditions"] = conds
        if job_phase in ("Pending", "Provisioning"):
            go("Provisioning", f"cannot reach the Ray dashboard: {observed.ray_job_error}")
        return d

    if job_info is None and observed.previous_running and _may_wait_for_previous(job, cur, now):
        # Never two attempts at once: they would share the checkpoint directory and the metrics port.
        st["conditions"] = conds
        st["message"] = (
            f"waiting for the previous attempt {observed.previous_running} to stop (it finishes its step and "
            "may save a checkpoint, within runPolicy.terminationGracePeriodSeconds)"
        )
        return d

    if job_info is None:
        d.actions.append("submit")
        d.submission_id = submission_id
        st["submissionId"] = submission_id
        st["headPod"] = head_pod_name(observed.raycluster)
        conds = set_condition(conds, "JobSubmitted", True, "Submitted", f"submitted {submission_id}", now)
        st["conditions"] = conds
        if job_phase in ("Pending", "Provisioning"):
            go("Provisioning", f"submitting trainer job {submission_id}")
        return d

    st["submissionId"] = job_info.submission_id
    if job_info.status == rayjobs.SUCCEEDED:
        # The driver exits 0 only after its last step, and its /metrics ends with it: the final step is
        # usually completed between two scrapes, so the count comes from that contract.
        st["step"] = spec.algorithm.total_steps
        st["progress"] = f"{spec.algorithm.total_steps}/{spec.algorithm.total_steps}"
        st["currentPhase"] = None
        exported = spec.checkpoint.export_dir()
        if exported:  # the driver exits 0 only after its end-of-run export (docs/trainer.md)
            st["exportPath"] = exported
        return finish(
            "Succeeded",
            "TrainingComplete",
            f"trained {spec.algorithm.total_steps} steps"
            + (f"; model exported to {exported}" if exported else ""),
        )

    bad_input = input_error(job_info)
    if bad_input is not None:
        return finish("Failed", "InvalidInput", f"the trainer refused its input (not restarted): {bad_input}")

    if job_info.status in (rayjobs.FAILED, rayjobs.STOPPED):
        reason = (
            f"Ray job {job_info.submission_id} {job_info.status.lower()}: {job_info.message[-300:]}".strip()
        )
        return restart_or_fail(reason, "BackoffLimitExceeded")

    if job_info.status == rayjobs.PENDING:
        st["conditions"] = conds
        if job_phase in ("Pending", "Provisioning"):
            go("Provisioning", f"trainer job {job_info.submission_id} is pending on the Ray cluster")
        return d

    # RUNNING.
    if not started:
        st["startTime"] = iso(now)
    if not st.get("headPod"):
        st["headPod"] = head_pod_name(observed.raycluster)
    if job_phase in ("Pending", "Provisioning", "Restarting", "Suspended"):
        go("Running", f"trainer job {job_info.submission_id} is running", "Running")
    conds = set_condition(conds, "Running", True, "Running", f"Ray job {job_info.submission_id} running", now)
    st["conditions"] = conds
    apply_metrics(job, observed, d)
    open_stall = st.get("openStall")
    if open_stall and int(st.get("step") or 0) > int(open_stall.get("step") or 0):
        st.pop("openStall")  # a step completed after the stall: it is over (through a restart, too)

    # Stall detection (seed problem 5): no completed step within stallTimeoutSeconds of the latest
    # progress. The clock of an attempt starts when it starts, so a restart gets a full timeout.
    attempt_started = max(
        t for t in (started or now, parse_time(cur.get("lastRestartTime"))) if t is not None
    )
    stall = detect_stall(
        spec.monitoring, observed.metrics, attempt_started, parse_time(cur.get("lastStepTime")), now
    )
    before = next(
        (c for c in st["conditions"] if c.get("type") == "Stalled" and c.get("status") == "True"), None
    )
    st["conditions"] = set_stalled_condition(st["conditions"], stall, now, generation)
    if stall is None:
        if job_phase == "Stalled":
            go("Running", f"step {st.get('step', 0)} completed: no longer stalled", "StallCleared")
        return d
    if before is None or before.get("reason") != stall.reason:  # a new stall, or now the step phase is known
        d.event("Stalled", f"{stall.reason}: {stall.message}", warning=True)
        d.new_stall = stall
        st["openStall"] = {
            "phase": stall.step_phase_label,
            "step": int(st.get("step") or 0),
            "since": iso(stall.last_progress),
        }
    timeout = spec.monitoring.stack_snapshot_timeout_seconds
    waiting = _diagnose(d, st, stall.reason, timeout, job_info.submission_id, observed)
    cond = next(c for c in st["conditions"] if c.get("type") == "Stalled")
    conds = st["conditions"]  # a restart's Running condition goes beside the Stalled one, not over it
    if spec.monitoring.on_stall == "Restart" and not waiting:
        d.actions.append("stop")
        d.stop_submission_id = job_info.submission_id
        return restart_or_fail(f"stalled ({stall.reason}): {cond['message']}", "StalledBackoffLimitExceeded")
    # The condition keeps its message while the same stall lasts; so does the status message (no patch
    # every reconcile just because the durations in it grew).
    st["phase"] = "Stalled"
    st["message"] = f"{cond['reason']}: {cond['message']}"
    if waiting and spec.monitoring.on_stall == "Restart":
        st["message"] += "; taking a stack snapshot before the restart"
    return d


def _diagnose(
    d: Decision, st: dict[str, Any], reason: str, timeout: int, attempt: str, observed: Observed
) -> bool:
    """The stall's stack snapshot (diagnosis.step) into `d`; True while it is being taken. Once taken,
    its verdict ends the Stalled condition's message."""
    since = parse_time((st.get("openStall") or {}).get("since"))
    if since is None:
        return False
    step = diagnosis.step(st.get("diagnosis"), since, reason, attempt, observed.stacks, observed.now, timeout)
    if step.status is not None:
        st["diagnosis"] = step.status
    if step.submit:
        d.actions.append("snapshot")
        d.snapshot_submission_id = step.submit
    if step.stop:
        d.actions.append("stop_snapshot")
        d.stop_snapshot_id = step.stop
    if step.record is not None:
        d.actions.append("record_stacks")
        d.stacks = step.record
    for event_reason, message in step.events:
        d.event(event_reason, message, warning=True)
    now_diag = step.status or {}
    said = now_diag.get("summary") if now_diag.get("state") != "Taking" else None
    if said and parse_time(now_diag.get("stallSince")) == since and now_diag.get("reason") in (None, reason):
        st["conditions"] = [
            {**c, "message": f"{c['message']}; stacks: {said}"}
            if c.get("type") == "Stalled" and c.get("status") == "True" and "; stacks: " not in c["message"]
            else c
            for c in st["conditions"]
        ]
    return step.waiting


def _may_wait_for_previous(job: RLHFJob, cur: dict[str, Any], now: datetime) -> bool:
    """Whether to go on waiting for a stopping previous attempt: for its stop budget and 30 s more after
    the restart (or admission) that ended it; past that Ray's own SIGKILL has failed, and waiting longer
    would hang the job."""
    since = parse_time(cur.get("lastRestartTime")) or parse_time(cur.get("activeSince"))
    limit = job.spec.run_policy.termination_grace_period_seconds + 30
    return since is None or (now - since).total_seconds() < limit


# Phases of a job whose RayCluster Kueue had admitted: suspended again now, it was evicted.
_ADMITTED_PHASES = ("Provisioning", "Running", "Stalled", "Restarting")


def _queued(
    d: Decision,
    job_phase: str,
    conds: list[dict[str, Any]],
    queue: str,
    observed: Observed,
    go: Any,
) -> Decision:
    """Kueue holds the job's RayCluster suspended: not admitted yet, or evicted (preempted). Nothing of
    the job runs, so nothing counts against the deadline or backoffLimit; an evicted attempt's trainer is
    told to stop (it saves at a step boundary, checkpoint.onPreemption) and is resubmitted on readmission."""
    st, now = d.status, observed.now
    reason, message = kueue.why_waiting(observed.workload, queue)
    for key in ("activeSince", "openStall", "currentPhase"):
        st.pop(key, None)
    # Admitted before: it said so (Queued=False, Admitted), or its trainer was submitted. (A new job is
    # Provisioning from its first write, before the operator has seen Kueue suspend its cluster.)
    admitted = any(c.get("type") == "Queued" and c.get("status") == "False" for c in conds)
    if job_phase in _ADMITTED_PHASES and (admitted or st.get("submissionId")):
        st["preemptions"] = int(st.get("preemptions") or 0) + 1
        if st.get("submissionId"):
            d.actions.append("stop")
            d.stop_submission_id = st["submissionId"]
        st.pop("submissionId", None)
        st.pop("headPod", None)
        conds = set_condition(conds, "Running", False, reason, f"evicted by Kueue: {message}", now)
        go(
            "Queued",
            f"evicted by Kueue ({reason}: {message}); requeued in LocalQueue {queue}, resumes from the "
            "last checkpoint when admitted",
            "Preempted" if reason in ("Preempted", "InCohortReclamation", "InClusterQueue") else "Evicted",
            warning=True,
        )
    else:
        go("Queued", f"queued in LocalQueue {queue}: {reason}: {message}", "Queued")
    st["message"] = f"queued in LocalQueue {queue}: {reason}: {message}"
    st["conditions"] = set_condition(conds, "Queued", True, reason, message, now)
    return d


def apply_metrics(job: RLHFJob, observed: Observed, d: Decision) -> None:
    """Copy the scraped trainer metrics into the status; missing metrics set MetricsUnavailable."""
    st = d.status
    conds: list[dict[str, Any]] = st.get("conditions", [])
    m = observed.metrics
    if m is None:
        reason = observed.metrics_error or "no metrics yet"
        st["conditions"] = set_condition(
            conds, "MetricsUnavailable", True, "ScrapeFailed", reason, observed.now
        )
        return
    st["conditions"] = set_condition(conds, "MetricsUnavailable", False, "Scraped", "", observed.now)
    # Throughput between two observed step completions: generated tokens per wall-clock second, from the
    # previous status (so it survives an operator restart). Computed before step/lastStepTime move on.
    prev_step, prev_tokens = int(st.get("step") or 0), st.get("generatedTokens")
    prev_time = parse_time(st.get("lastStepTime"))
    if m.last_step_completed_ts and m.steps_completed > prev_step and prev_tokens is not None and prev_time:
        new_time = datetime.fromtimestamp(m.last_step_completed_ts, UTC)
        delta = m.generated_tokens_total - float(prev_tokens)
        if new_time > prev_time and delta >= 0:
            st["tokensPerSecond"] = round(delta / (new_time - prev_time).total_seconds(), 1)
    if m.steps_completed != prev_step or prev_tokens is None:
        st["generatedTokens"] = int(m.generated_tokens_total)
    st["step"] = m.steps_completed
    st["conditions"], degraded = fabric_condition(
        st["conditions"], asks_rdma(job.spec), m.nccl_networks, observed.now
    )
    if degraded:
        d.event("FabricDegraded", degraded, warning=True)
    total = m.total_steps or job.spec.algorithm.total_steps
    st["totalSteps"] = total
    st["progress"] = f"{m.steps_completed}/{total}"
    # Before a run's first step the trainer's timestamp holds the driver's start (so the step-stall alert
    # covers step 1); that is not a step completion, so lastStepTime only moves when the step count does.
    if m.last_step_completed_ts and (m.steps_completed > prev_step or (m.steps_completed and not prev_time)):
        st["lastStepTime"] = iso(datetime.fromtimestamp(m.last_step_completed_ts, UTC))
    if m.step_phase_seconds:
        st["phaseSeconds"] = {k: round(v, 3) for k, v in sorted(m.step_phase_seconds.items())}
    share = m.generation_share
    if share is not None:
        st["generationShare"] = round(share, 3)
    st["currentPhase"] = m.in_progress_step_phase  # None (removed) between phases
    if m.reward_mean is not None and math.isfinite(m.reward_mean):
        st["rewardMean"] = round(m.reward_mean, 4)
    if m.kl is not None and math.isfinite(m.kl):
        st["kl"] = round(m.kl, 6)
    if m.steps_completed:  # the idle gauges read 0 until a step of this attempt completes
        for key, ratio in (
            ("trainerIdleRatio", m.trainer_idle_ratio),
            ("rolloutIdleRatio", m.rollout_idle_ratio),
        ):
            if ratio is not None and math.isfinite(ratio):
                st[key] = round(ratio, 3)
    if m.sample_staleness is not None:
        st["sampleStaleness"] = round(m.sample_staleness, 3)
    if m.stale_samples_total is not None:
        st["staleSamples"] = int(m.stale_samples_total)
    if m.last_checkpoint_step is not None:  # absent: keep the last known (checkpoints outlive attempts)
        st["lastCheckpointStep"] = m.last_checkpoint_step
    if m.engines:
        rollout = dict(st.get("rollout") or {})
        rollout["readyEngines"] = int(m.engines.get("ready", 0))
        st["rollout"] = rollout


def status_patch(current: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """A merge patch with only the changed top-level status fields (None deletes)."""
    patch: dict[str, Any] = {}
    for key in set(current) | set(new):
        if current.get(key) != new.get(key):
            patch[key] = new.get(key)
    return patch


def cluster_rejected(job: RLHFJob, code: int | None, message: str, now: datetime) -> Decision:
    """The status after the API server refused to create the job's RayCluster with `code` and `message`.

    A permanent refusal (pod_problems.rejection_is_permanent) fails the job at once, restarts untouched:
    retrying cannot help until the job or the cluster's policy changes. A transient one keeps the job
    waiting, with the server's words in status.message while the handler retries with backoff.
    """
    cur: dict[str, Any] = (
        job.status.model_dump(by_alias=True, exclude_none=True, mode="json") if job.status else {}
    )
    st = dict(cur)
    # The create handler may be refused before any status exists: the fields a new job always has.
    st.setdefault("restarts", 0)
    st.setdefault("totalSteps", job.spec.algorithm.total_steps)
    d = Decision(status=st)
    name = raycluster_name(job.name)
    permanent = rejection_is_permanent(code, message)
    text = f"the API server refused RayCluster {name} ({code}): {message}"
    conds = list(cur.get("conditions", []))
    if permanent:
        st.update(phase="Failed", message=text, completionTime=iso(now))
        st.pop("openStall", None)
        conds = set_condition(conds, "Failed", True, "RayClusterRejected", text, now)
        conds = set_condition(conds, "Running", False, "RayClusterRejected", text, now)
        d.event("RayClusterRejected", text, warning=True)
    else:
        retry = f"{text}; retrying"
        if cur.get("message") != retry:
            d.event("RayClusterCreateFailed", retry, warning=True)
        st.update(phase=cur.get("phase") or "Provisioning", message=retry)
        conds = set_condition(conds, "ClusterReady", False, "RayClusterCreateFailed", retry, now)
    st["conditions"] = conds
    return d
