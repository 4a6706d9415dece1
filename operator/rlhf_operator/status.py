"""(RayCluster, Ray job, scraped metrics, Kueue, engine plan inputs, clock) -> the RLHFJob's next status and
the typed actions to take: a state machine over the job's phase.

Pure: no Kubernetes, Ray or HTTP calls. `decide` reads the typed status (`RLHFJobStatus`), looks up the
steps of the job's phase in `PHASE_STEPS` and runs them in order until one decides the round; then the
engine plan (`scaling.plan_engines`, held while Kueue holds the replicas) sizes the rollout group. The
handler observes the world, calls `decide`, carries out `Decision.actions` (act.py) and patches the
status diff. Level-triggered and idempotent: an operator killed at any point converges on restart.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from rlhf_api.constants import INPUT_ERROR_EXIT_CODE
from rlhf_api.spec import (
    TERMINAL_JOB_PHASES,
    Condition,
    JobPhase,
    OpenStall,
    RLHFJob,
    RLHFJobSpec,
    RLHFJobStatus,
    RolloutStatus,
    StallDiagnosis,
)

from rlhf_operator import diagnosis, kueue, model_fetch, rayjobs, scaling
from rlhf_operator.actions import (
    Action,
    AwaitCreateBackoff,
    CreateCluster,
    Decision,
    DeleteCluster,
    DeleteJob,
    Event,
    RecordStacks,
    ScaleRolloutGroup,
    SetClusterSuspend,
    StopRayJob,
    StopSnapshot,
    SubmitSnapshot,
    SubmitTrainer,
    WriteEngines,
    event,
)
from rlhf_operator.conditions import parse_time
from rlhf_operator.manifests import (
    JOB_LABEL,
    ROLE_LABEL,
    effective_engines,
    raycluster_name,
    remote_models,
    rollout_replicas,
    scale_patch,
)
from rlhf_operator.pod_problems import diagnose, rejection_is_permanent
from rlhf_operator.progress import apply_metrics, conditions_typed, conditions_wire, second, upsert_condition
from rlhf_operator.scrape import ScrapedMetrics
from rlhf_operator.stall import Stall, detect_stall, set_stalled_condition

__all__ = ["Decision", "Observed", "cluster_rejected", "decide", "status_patch"]


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
    # The engine plan's inputs: the rollout worker pods (None: not read; cache.rollout_pods) for the
    # EnginesPending condition.
    rollout_pods: list[dict[str, Any]] | None = None
    # Our last patch of the RayCluster has not come back through the watch yet: patching it again would be
    # a second write of the same change (cache.patch_in_flight).
    cluster_patch_pending: bool = False
    # A transient refusal of the RayCluster's create is backing off (cache.create_backing_off).
    create_backoff: bool = False
    # The last lines of the head's fetch-models log, read while it runs (model_fetch.fetching_pod).
    fetch_log: str | None = None


@dataclass(frozen=True)
class Round:
    """The inputs of one decision, typed: the job, its stored status, what was observed."""

    job: RLHFJob
    cur: RLHFJobStatus  # the status as stored
    observed: Observed
    submission_id: str  # the current attempt's id (from restarts and preemptions)
    queue: str | None  # the LocalQueue of a Kueue-managed job

    @property
    def spec(self) -> RLHFJobSpec:
        return self.job.spec

    @property
    def now(self) -> datetime:
        return self.observed.now

    @property
    def cluster(self) -> dict[str, Any] | None:
        return self.observed.raycluster

    @property
    def generation(self) -> int | None:
        return int(self.job.metadata.get("generation") or 0) or None


@dataclass
class Draft:
    """The decision being built by one round's steps; local to one `decide` call. `phase` is the phase the
    steps reason from (the stored one, or Provisioning once Kueue admitted a queued job)."""

    st: RLHFJobStatus
    phase: JobPhase
    actions: list[Action] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    new_stall: Stall | None = None

    def go(
        self,
        phase: JobPhase,
        message: str,
        reason: str | None = None,
        warning: bool = False,
        every: bool = False,
    ) -> None:
        """Move to `phase` with `message`; an Event (`reason`, else the phase's name) when the phase changes,
        or each time with `every` (a restart: an attempt that fails before it is seen running restarts
        from Restarting, and each restart is an Event and a count of rlhf_operator's restarts counter)."""
        if phase != self.phase or every:
            self.events.append(event(reason or phase, message, warning))
        self.st.phase = phase
        self.st.message = message

    def cond(self, ctype: str, status: bool, reason: str, message: str, now: datetime) -> None:
        """Upsert a condition; its lastTransitionTime changes only when its status flips."""
        self.st.conditions = upsert_condition(self.st.conditions or [], ctype, status, reason, message, now)

    def has(self, ctype: str, status: str | None = None) -> Condition | None:
        """The condition of type `ctype` (with status `status`, if given), if any."""
        return next(
            (c for c in self.st.conditions or [] if c.type == ctype and status in (None, c.status)), None
        )

    def add(self, action: Action) -> None:
        """Add `action` unless it is already due (a restart past backoffLimit finishes the job: one stop,
        one delete)."""
        if action not in self.actions:
            self.actions.append(action)

    def stop(self, ray_job: rayjobs.RayJobInfo | None) -> None:
        """Stop `ray_job` if it has not ended."""
        if ray_job is not None and ray_job.status not in rayjobs.TERMINAL:
            self.add(StopRayJob(ray_job.submission_id))

    def decision(self) -> Decision:
        return Decision(self.st, tuple(self.actions), tuple(self.events), self.new_stall)


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


# A step of a phase: True when it decided the round (the steps after it do not run).
Step = Callable[[Round, Draft], bool]


def decide(job: RLHFJob, observed: Observed, submission_id: str) -> Decision:
    """The next status and actions. `submission_id` is the id of the current attempt (from restarts)."""
    cur = job.status or RLHFJobStatus()
    r = Round(
        job, cur, observed, submission_id, kueue.queue_name(job.metadata.get("labels"), observed.raycluster)
    )
    d = Draft(_normalised(r), cur.phase or "Pending")
    for step in PHASE_STEPS[d.phase]:
        if step(r, d):
            break
    _engines(r, d)
    if observed.create_backoff and any(isinstance(a, CreateCluster) for a in d.actions):
        d.actions, d.events = [AwaitCreateBackoff()], []  # nothing this round; the status says why
    return d.decision()


def _normalised(r: Round) -> RLHFJobStatus:
    """The stored status with what every round writes: generation, total steps, cluster name, selector."""
    cur, spec = r.cur, r.spec
    # desiredEngines is not here: `_engines` writes it, once a round (the plan's count, or the request's)
    rollout = (cur.rollout or RolloutStatus()).model_copy(
        update={"selector": f"{JOB_LABEL}={r.job.name},{ROLE_LABEL}=rollout"}
    )
    update: dict[str, Any] = {
        "observed_generation": r.generation,
        "total_steps": spec.algorithm.total_steps,
        "restarts": cur.restarts or 0,
        "progress": cur.progress or f"{cur.step or 0}/{spec.algorithm.total_steps}",
        "rollout": rollout,
        "conditions": list(cur.conditions or []),
    }
    if r.cluster:
        update["ray_cluster_name"] = r.cluster["metadata"]["name"]
    return cur.model_copy(update=update)


# ----------------------------------------------------------------------------------- finished phases


def _finished(r: Round, d: Draft) -> bool:
    """Succeeded and Failed stay; only the cluster's release and the TTL clock remain."""
    if r.cluster:
        d.add(DeleteCluster())
    ttl = r.spec.run_policy.ttl_seconds_after_finished
    done = r.cur.completion_time
    if ttl is not None and done and (r.now - done).total_seconds() >= ttl:
        d.add(DeleteJob())
    return True


def _finish(r: Round, d: Draft, phase: JobPhase, reason: str, message: str) -> bool:
    """-> Succeeded or Failed: stop the trainer, release the cluster."""
    d.go(phase, message, reason, warning=phase == "Failed")
    d.st.completion_time = second(r.now)
    d.st.open_stall = None  # a finished job has no stall to resolve
    d.cond("Succeeded" if phase == "Succeeded" else "Failed", True, reason, message, r.now)
    d.cond("Running", False, reason, message, r.now)
    d.stop(r.observed.ray_job)
    if r.cluster:
        d.add(DeleteCluster())
    return True


def _restart_or_fail(r: Round, d: Draft, reason: str, limit_reason: str) -> bool:
    """-> Restarting from the last checkpoint within runPolicy.backoffLimit, else -> Failed."""
    restarts, limit = d.st.restarts or 0, r.spec.run_policy.backoff_limit
    if restarts >= limit:
        return _finish(r, d, "Failed", limit_reason, f"{reason}; backoffLimit {limit} reached")
    d.st.restarts = restarts + 1
    d.st.last_restart_time = second(r.now)
    d.st.submission_id = None
    message = f"{reason}; restart {restarts + 1}/{limit} from the last checkpoint"
    d.go("Restarting", message, "Restarting", warning=True, every=True)
    d.cond("Running", False, "Restarting", reason, r.now)
    return True


# ------------------------------------------------------------------ holds: suspended, queued, deadline


def _held(r: Round, d: Draft) -> bool:
    """-> Suspended (runPolicy.suspend) or -> Queued (Kueue holds the RayCluster suspended)."""
    if r.spec.run_policy.suspend:
        return _suspend(r, d)
    if r.queue and kueue.suspended_by_kueue(r.cluster, True):
        return _queue(r, d, r.queue)
    return False


def _suspend(r: Round, d: Draft) -> bool:
    """Keep the CR, release the pods, stop the trainer; it resumes from its checkpoint."""
    cluster = r.cluster
    if cluster and r.queue:
        d.add(DeleteCluster())  # releases Kueue's quota with it; recreated (queued) on resume
    elif cluster and not cluster.get("spec", {}).get("suspend") and not r.observed.cluster_patch_pending:
        d.add(SetClusterSuspend(True))
    d.stop(r.observed.ray_job)
    d.st.active_since = None  # the deadline clock starts again on resume, as for a Kubernetes Job
    d.go("Suspended", "runPolicy.suspend is true: pods released, resumes from the last checkpoint")
    d.cond("Suspended", True, "Suspended", "suspended by runPolicy.suspend", r.now)
    return True


# Phases of a job whose RayCluster Kueue had admitted: suspended again now, it was evicted.
_ADMITTED_PHASES = ("Provisioning", "Running", "Stalled", "Restarting")
_PREEMPTED = ("Preempted", "InCohortReclamation", "InClusterQueue")


def _queue(r: Round, d: Draft, queue: str) -> bool:
    """Kueue holds the job's RayCluster suspended: not admitted yet, or evicted (preempted). Nothing of
    the job runs, so nothing counts against the deadline or backoffLimit; an evicted attempt's trainer is
    told to stop (it saves at a step boundary, checkpoint.onPreemption) and is resubmitted on readmission."""
    st = d.st
    reason, message = kueue.why_waiting(r.observed.workload, queue)
    st.active_since = st.open_stall = st.current_phase = None
    # Admitted before: it said so (Queued=False, Admitted), or its trainer was submitted. (A new job is
    # Provisioning from its first write, before the operator has seen Kueue suspend its cluster.)
    if d.phase in _ADMITTED_PHASES and (d.has("Queued", "False") or st.submission_id):
        st.preemptions = (st.preemptions or 0) + 1
        if st.submission_id:
            d.add(StopRayJob(st.submission_id))
        st.submission_id = st.head_pod = None
        d.cond("Running", False, reason, f"evicted by Kueue: {message}", r.now)
        d.go(
            "Queued",
            f"evicted by Kueue ({reason}: {message}); requeued in LocalQueue {queue}, resumes from the "
            "last checkpoint when admitted",
            "Preempted" if reason in _PREEMPTED else "Evicted",
            warning=True,
        )
    else:
        d.go("Queued", f"queued in LocalQueue {queue}: {reason}: {message}", "Queued")
    st.message = f"queued in LocalQueue {queue}: {reason}: {message}"
    d.cond("Queued", True, reason, message, r.now)
    return True


def _released(r: Round, d: Draft) -> bool:
    """Not held: un-suspend the cluster we suspended, and say the job is no longer suspended or queued."""
    cluster = r.cluster
    if cluster and cluster.get("spec", {}).get("suspend") and not r.observed.cluster_patch_pending:
        d.add(SetClusterSuspend(r.spec.run_policy.suspend))  # false: un-suspend
    if d.has("Suspended"):
        d.cond("Suspended", False, "NotSuspended", "", r.now)
    if r.queue and d.has("Queued", "True"):
        d.cond("Queued", False, "Admitted", f"admitted by Kueue from {r.queue}", r.now)
    return False


def _admitted(r: Round, d: Draft) -> bool:
    """Queued -> Provisioning: Kueue admitted the job; the deadline counts from now, as after an
    unsuspension."""
    d.st.active_since = second(r.now)
    d.go("Provisioning", f"admitted by Kueue from LocalQueue {r.queue}: starting the RayCluster", "Admitted")
    d.phase = "Provisioning"
    return False


def _deadline(r: Round, d: Draft) -> bool:
    """-> Failed past runPolicy.activeDeadlineSeconds, counted like a Kubernetes Job's: from the job's
    creation, or its last unsuspension, so time stuck provisioning counts too."""
    st = d.st
    if st.active_since is None:  # a new job: its creation; a resumed one: now; an older one: its start
        created = parse_time(r.job.metadata.get("creationTimestamp"))
        since = created if d.phase == "Pending" else r.now if d.phase == "Suspended" else r.cur.start_time
        st.active_since = second(since or r.now)
    deadline = r.spec.run_policy.active_deadline_seconds
    if deadline is None or (r.now - st.active_since).total_seconds() <= deadline:
        return False
    where = "" if d.phase in ("Running", "Stalled") else f" ({st.message or d.phase})"
    message = f"active longer than runPolicy.activeDeadlineSeconds={deadline}{where}"
    return _finish(r, d, "Failed", "DeadlineExceeded", message)


# --------------------------------------------------------------------------- the attempt's RayCluster


def _latest(*times: datetime | None) -> datetime | None:
    """The latest of the times that are set: where an attempt's clocks start (its job's start, its last
    restart, its last resume or Kueue admission)."""
    return max((t for t in times if t is not None), default=None)


def _provisioning_timeout(r: Round, d: Draft) -> bool:
    """-> Restarting or Failed (runPolicy.onProvisioningTimeout): this attempt has not reached a running
    trainer within runPolicy.provisioningTimeoutSeconds."""
    timeout, st = r.spec.run_policy.provisioning_timeout_seconds, d.st
    attempt_start = _latest(st.active_since, r.cur.last_restart_time) or r.now
    if timeout is None or (r.now - attempt_start).total_seconds() <= timeout:
        return False
    why = f"not running after runPolicy.provisioningTimeoutSeconds={timeout}: {st.message or d.phase}"
    if r.spec.run_policy.on_provisioning_timeout != "Restart":
        return _finish(r, d, "Failed", "ProvisioningTimeout", why)
    if r.cluster:
        d.add(DeleteCluster())  # new pods, perhaps on other nodes
    return _restart_or_fail(r, d, why, "ProvisioningTimeout")


def _missing_cluster(r: Round, d: Draft) -> bool:
    """No RayCluster: create it. Suspended -> Pending (resumed); a running job's -> Provisioning."""
    if r.cluster is not None:
        return False
    d.st.head_pod = None  # the next attempt's head is the new cluster's
    d.add(CreateCluster())
    if d.phase == "Suspended":
        d.go(
            "Pending", "resumed: creating the RayCluster; the trainer resumes from its checkpoint", "Resumed"
        )
    elif d.phase not in ("Pending", "Restarting"):
        message = "RayCluster missing: recreating it; the trainer resumes from its checkpoint"
        d.go("Provisioning", message, "ClusterRecreated", warning=True)
    else:
        d.go(d.phase, "creating the RayCluster")
    return True


def _head_lost(r: Round, d: Draft) -> bool:
    """Running or Stalled -> Restarting: the attempt's head pod was replaced or is gone; its driver and the
    GCS went with it, whatever the RayCluster's state says."""
    lost = head_lost(r.cluster, r.cur.head_pod)
    if not lost:
        return False
    d.st.head_pod = None
    return _restart_or_fail(
        r, d, f"{lost}: the trainer's driver and the GCS went with it", "BackoffLimitExceeded"
    )


def _models(r: Round, d: Draft) -> bool:
    """Remote models (hf://, s3://): ModelsReady follows the head's fetch step; a permanent failure (a
    missing model or revision, refused credentials) fails the job at once: every attempt would fail alike.
    Once the cluster is ready the step has succeeded (the head's Ray container runs only after it)."""
    if not remote_models(r.spec):
        return False
    state = model_fetch.fetch_state(r.observed.pods or [], r.observed.fetch_log)
    if cluster_ready(r.cluster):
        if state is not None and state.phase == "done":  # its bytes, from the head's finished step
            d.cond("ModelsReady", *model_fetch.models_condition(state), r.now)
        elif not d.has("ModelsReady", "True"):
            d.cond("ModelsReady", True, "ModelsFetched", "models fetched into the cache", r.now)
        return False
    if state is None:
        return False
    if state.permanent:
        d.cond("ModelsReady", False, state.reason, state.message, r.now)
        return _finish(
            r, d, "Failed", state.reason, f"the models cannot be fetched (not restarted): {state.message}"
        )
    status, reason, message = model_fetch.models_condition(state)
    d.cond("ModelsReady", status, reason, message, r.now)
    return False


def _starting(d: Draft, message: str) -> None:
    """Pending or Provisioning -> Provisioning. A resumed job too (Suspended, its RayCluster un-suspended or
    its trainer submitted): it is no longer suspended, though its trainer does not run yet (a Resumed
    Event). Restarting and the running phases keep theirs."""
    if d.phase in ("Pending", "Provisioning"):
        d.go("Provisioning", message)
    elif d.phase == "Suspended":
        d.go("Provisioning", f"resumed: {message}", "Resumed")


def _unready_cluster(r: Round, d: Draft) -> bool:
    """The RayCluster is not ready: Pending -> Provisioning with KubeRay's or the pods' reason."""
    name = d.st.ray_cluster_name
    if cluster_ready(r.cluster):
        d.cond("ClusterReady", True, "ClusterReady", "RayCluster is ready", r.now)
        return False
    problem, pod_problem = cluster_problem(r.cluster), diagnose(r.observed.pods or [])
    msg = f"waiting for RayCluster {name} to be ready"
    if problem:
        msg = f"RayCluster {name} is not ready: {problem}"
    elif pod_problem:
        msg = f"RayCluster {name} is not ready: {pod_problem.describe()}"
    d.cond("ClusterReady", False, "ClusterNotReady", msg, r.now)
    before = d.has("PodsReady")
    if pod_problem:
        if not before or before.status != "False" or before.reason != pod_problem.reason:
            d.events.append(event(pod_problem.reason, pod_problem.describe(), warning=True))  # once a reason
        d.cond("PodsReady", False, pod_problem.reason, pod_problem.describe(), r.now)
    elif before is not None and before.status == "False":
        d.cond("PodsReady", True, "PodsScheduled", "no pod problem found", r.now)
    if d.phase == "Restarting":
        d.go("Restarting", msg)
    else:
        _starting(d, msg)
    return True


# --------------------------------------------------------------------------------- the attempt's Ray job


def _attempt(r: Round, d: Draft) -> bool:
    """The cluster is ready: follow the attempt's Ray job."""
    info = r.observed.ray_job
    if info is None:
        return _no_ray_job(r, d)
    d.st.submission_id = info.submission_id
    if info.status == rayjobs.SUCCEEDED:
        return _succeeded(r, d)
    bad_input = input_error(info)
    if bad_input is not None:
        message = f"the trainer refused its input (not restarted): {bad_input}"
        return _finish(r, d, "Failed", "InvalidInput", message)
    if info.status in (rayjobs.FAILED, rayjobs.STOPPED):
        reason = f"Ray job {info.submission_id} {info.status.lower()}: {info.message[-300:]}".strip()
        return _restart_or_fail(r, d, reason, "BackoffLimitExceeded")
    if info.status == rayjobs.PENDING:
        _starting(d, f"trainer job {info.submission_id} is pending on the Ray cluster")
        return True
    return _running(r, d, info)


def _no_ray_job(r: Round, d: Draft) -> bool:
    """No Ray job for the attempt: submit it, once the dashboard answers and the previous one has ended."""
    error, previous = r.observed.ray_job_error, r.observed.previous_running
    if error:
        d.cond("JobSubmitted", False, "RayDashboardUnavailable", error, r.now)
        _starting(d, f"cannot reach the Ray dashboard: {error}")
        return True
    if previous and _may_wait_for_previous(r):
        # Never two attempts at once: they would share the checkpoint directory and the metrics port.
        d.st.message = (
            f"waiting for the previous attempt {previous} to stop (it finishes its step and "
            "may save a checkpoint, within runPolicy.terminationGracePeriodSeconds)"
        )
        return True
    d.add(SubmitTrainer(r.submission_id))
    d.st.submission_id = r.submission_id
    d.st.head_pod = head_pod_name(r.cluster)
    d.cond("JobSubmitted", True, "Submitted", f"submitted {r.submission_id}", r.now)
    _starting(d, f"submitting trainer job {r.submission_id}")
    return True


def _may_wait_for_previous(r: Round) -> bool:
    """Whether to go on waiting for a stopping previous attempt: for its stop budget and 30 s more after
    the restart (or admission) that ended it; past that Ray's own SIGKILL has failed, and waiting longer
    would hang the job."""
    since = _latest(r.cur.last_restart_time, r.cur.active_since)
    limit = r.spec.run_policy.termination_grace_period_seconds + 30
    return since is None or (r.now - since).total_seconds() < limit


def _succeeded(r: Round, d: Draft) -> bool:
    """-> Succeeded. The driver exits 0 only after its last step (and its end-of-run export), and its
    /metrics ends with it: the final step is usually completed between two scrapes, so the count comes
    from that contract."""
    total = r.spec.algorithm.total_steps
    d.st.step, d.st.progress, d.st.current_phase = total, f"{total}/{total}", None
    exported = r.spec.checkpoint.export_dir()
    if exported:
        d.st.export_path = exported
    message = f"trained {total} steps" + (f"; model exported to {exported}" if exported else "")
    return _finish(r, d, "Succeeded", "TrainingComplete", message)


# ------------------------------------------------------------------------------ running: metrics, stalls


def _running(r: Round, d: Draft, info: rayjobs.RayJobInfo) -> bool:
    """The Ray job runs: -> Running; the metrics into the status; a stall -> Stalled (or Restarting)."""
    st = d.st
    if not r.cur.start_time:
        st.start_time = second(r.now)
    if not st.head_pod:
        st.head_pod = head_pod_name(r.cluster)
    if d.phase in ("Pending", "Provisioning", "Restarting", "Suspended"):
        d.go("Running", f"trainer job {info.submission_id} is running", "Running")
    d.cond("Running", True, "Running", f"Ray job {info.submission_id} running", r.now)
    d.st, degraded = apply_metrics(st, r.spec, r.observed.metrics, r.observed.metrics_error, r.now)
    if degraded:
        d.events.append(event("FabricDegraded", degraded, warning=True))
    open_stall = d.st.open_stall
    if open_stall and (d.st.step or 0) > open_stall.step:
        d.st.open_stall = None  # a step completed after the stall: it is over (through a restart, too)
    return _stall(r, d, info)


def _stall(r: Round, d: Draft, info: rayjobs.RayJobInfo) -> bool:
    """Stall detection: no completed step within stallTimeoutSeconds of the latest progress. The clock of
    an attempt starts when it starts, so a restart gets a full timeout, and so does a resume or a Kueue
    readmission (activeSince: the first attempt's start and last step may be hours old, and the new
    attempt serves no metrics while it starts). Stalled -> Running when it clears."""
    st, monitoring = d.st, r.spec.monitoring
    started = _latest(r.cur.start_time or r.now, r.cur.last_restart_time, r.cur.active_since) or r.now
    stall = detect_stall(monitoring, r.observed.metrics, started, r.cur.last_step_time, r.now)
    before = d.has("Stalled", "True")
    if stall is not None or d.has("Stalled"):  # else set_stalled_condition changes nothing
        stalled = set_stalled_condition(conditions_wire(st.conditions), stall, r.now, r.generation)
        st.conditions = conditions_typed(stalled)
    if stall is None:
        if d.phase == "Stalled":
            d.go("Running", f"step {st.step or 0} completed: no longer stalled", "StallCleared")
        return True
    if before is None or before.reason != stall.reason:  # a new stall, or now the step phase is known
        d.events.append(event("Stalled", f"{stall.reason}: {stall.message}", warning=True))
        d.new_stall = stall
        st.open_stall = OpenStall(
            phase=stall.step_phase_label, step=st.step or 0, since=second(stall.last_progress)
        )
    waiting = _diagnose(r, d, stall.reason, info.submission_id)
    cond = d.has("Stalled")
    assert cond is not None
    if monitoring.on_stall == "Restart" and not waiting:
        d.add(StopRayJob(info.submission_id))
        why = f"stalled ({stall.reason}): {cond.message}"
        return _restart_or_fail(r, d, why, "StalledBackoffLimitExceeded")
    # The condition keeps its message while the same stall lasts; so does the status message (no patch
    # every reconcile just because the durations in it grew).
    st.phase, st.message = "Stalled", f"{cond.reason}: {cond.message}"
    if waiting and monitoring.on_stall == "Restart":
        st.message += "; taking a stack snapshot before the restart"
    return True


def _diagnose(r: Round, d: Draft, reason: str, attempt: str) -> bool:
    """The stall's stack snapshot (diagnosis.step) into the draft; True while it is being taken. Once taken,
    its verdict ends the Stalled condition's message."""
    st = d.st
    since = st.open_stall.since if st.open_stall else None
    if since is None:
        return False
    current = st.diagnosis.model_dump(by_alias=True, exclude_none=True, mode="json") if st.diagnosis else None
    timeout = r.spec.monitoring.stack_snapshot_timeout_seconds
    step = diagnosis.step(current, since, reason, attempt, r.observed.stacks, r.now, timeout)
    if step.status is not None:
        st.diagnosis = StallDiagnosis.model_validate(step.status)
    if step.submit:
        d.add(SubmitSnapshot(step.submit))
    if step.stop:
        d.add(StopSnapshot(step.stop))
    if step.record is not None:
        d.add(RecordStacks(step.record))
    d.events.extend(event(event_reason, message, warning=True) for event_reason, message in step.events)
    taken = st.diagnosis if st.diagnosis and st.diagnosis.state != "Taking" else None
    if taken and taken.summary and taken.stall_since == since and taken.reason in (None, reason):
        st.conditions = [
            c.model_copy(update={"message": f"{c.message}; stacks: {taken.summary}"})
            if c.type == "Stalled" and c.status == "True" and "; stacks: " not in c.message
            else c
            for c in st.conditions or []
        ]
    return step.waiting


# ------------------------------------------------------------------------------------- the engine plan


def _engines(r: Round, d: Draft) -> None:
    """`status.rollout.desiredEngines`, written here only: the engine count of scaling.plan_engines while
    the job has a cluster and goes on, else the request's (clamped: manifests.effective_engines), also
    while Kueue holds the cluster's replicas (kueue.holds_replicas; a fixed-size admitted workload then
    says so, once)."""
    cluster = r.cluster
    requested = effective_engines(r.spec)
    if (
        cluster is None
        or d.st.phase in TERMINAL_JOB_PHASES
        or any(isinstance(a, DeleteCluster) for a in d.actions)
    ):
        _set_desired(d, requested)
        return
    if r.queue and kueue.holds_replicas(cluster):
        _set_desired(d, requested)
        if not kueue.suspended_by_kueue(cluster, True):
            conds, said = kueue.fixed_size_condition(conditions_wire(d.st.conditions), requested, r.now)
            d.st.conditions = conditions_typed(conds)
            if said:
                d.events.append(event("EngineScalingOff", said, warning=True))
        return
    plan, conditions = _plan(r, d.st)
    if plan.write_spec:
        d.actions.insert(0, WriteEngines(plan.requested, plan.engines, plan.direction))
    _merge_plan(d, plan.status, conditions)
    d.events.extend(Event(*e) for e in plan.events)
    replicas = rollout_replicas(r.spec, plan.engines)
    ops = scale_patch(cluster, replicas)
    suspending = any(isinstance(a, SetClusterSuspend) for a in d.actions)
    if ops and not r.observed.cluster_patch_pending and not suspending:
        d.add(ScaleRolloutGroup(replicas, tuple(ops)))


def _set_desired(d: Draft, engines: int) -> None:
    rollout = d.st.rollout or RolloutStatus()
    d.st.rollout = rollout.model_copy(update={"desired_engines": engines})


def _plan(r: Round, st: RLHFJobStatus) -> tuple[scaling.EnginePlan, list[dict[str, Any]] | None]:
    """scaling.plan_engines over the fields it reads of the stored and the next status (not whole dumps:
    this runs every round of every job); with the conditions it was given, if any."""
    cur = r.cur
    previous = {
        "rollout": {"desiredEngines": cur.rollout.desired_engines} if cur.rollout else {},
        "lastScaleTime": cur.last_scale_time,
        "lastScaleStep": cur.last_scale_step,
    }
    rollout = st.rollout.model_dump(by_alias=True, exclude_none=True, mode="json") if st.rollout else {}
    now: dict[str, Any] = {
        "step": st.step,
        "phase": st.phase,
        "generationShare": st.generation_share,
        "rollout": rollout,
    }
    conditions = conditions_wire(st.conditions) if r.observed.rollout_pods is not None else None
    if conditions is not None:
        now["conditions"] = conditions
    return scaling.plan_engines(r.spec, previous, now, r.now, r.observed.rollout_pods), conditions


def _merge_plan(d: Draft, plan_status: Mapping[str, Any], conditions: list[dict[str, Any]] | None) -> None:
    """The plan's status fields (rollout, lastScaleTime, lastScaleStep, conditions) into the draft."""
    update: dict[str, Any] = {"rollout": RolloutStatus.model_validate(plan_status["rollout"])}
    if "lastScaleTime" in plan_status:
        update["last_scale_time"] = parse_time(plan_status["lastScaleTime"])
        update["last_scale_step"] = plan_status["lastScaleStep"]
    if "conditions" in plan_status and plan_status["conditions"] != conditions:
        update["conditions"] = conditions_typed(plan_status["conditions"])
    d.st = d.st.model_copy(update=update)


# The state machine: the steps of each phase, in order; the first that decides ends the round.
_RUNNING: tuple[Step, ...] = (
    _held,
    _released,
    _deadline,
    _missing_cluster,
    _head_lost,
    _unready_cluster,
    _attempt,
)
_STARTING: tuple[Step, ...] = (
    _held, _released, _deadline, _provisioning_timeout, _missing_cluster, _models, _unready_cluster, _attempt,
)  # fmt: skip
PHASE_STEPS: Mapping[JobPhase, tuple[Step, ...]] = {
    "Pending": _STARTING,
    "Provisioning": _STARTING,
    "Restarting": _STARTING,
    "Queued": (_held, _released, _admitted, *_STARTING[2:]),
    "Suspended": (_held, _released, _deadline, _missing_cluster, _unready_cluster, _attempt),
    "Running": _RUNNING,
    "Stalled": _RUNNING,
    "Succeeded": (_finished,),
    "Failed": (_finished,),
}


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
    cur = job.status or RLHFJobStatus()
    # The create handler may be refused before any status exists: the fields a new job always has.
    total = job.spec.algorithm.total_steps if cur.total_steps is None else cur.total_steps
    st = cur.model_copy(update={"restarts": cur.restarts or 0, "total_steps": total})
    d = Draft(st, cur.phase or "Provisioning")
    text = f"the API server refused RayCluster {raycluster_name(job.name)} ({code}): {message}"
    if rejection_is_permanent(code, message):
        st.phase, st.message, st.completion_time, st.open_stall = "Failed", text, second(now), None
        d.events.append(event("RayClusterRejected", text, warning=True))
        d.cond("Failed", True, "RayClusterRejected", text, now)
        d.cond("Running", False, "RayClusterRejected", text, now)
    else:
        retry = f"{text}; retrying"
        if cur.message != retry:
            d.events.append(event("RayClusterCreateFailed", retry, warning=True))
        st.phase, st.message = cur.phase or "Provisioning", retry
        d.cond("ClusterReady", False, "RayClusterCreateFailed", retry, now)
    return d.decision()
