"""Why a job's pods are not running, from the pods themselves, and how the API server's refusal of a
RayCluster is classified. Pure.

A job stuck before its trainer starts used to sit in Provisioning saying only "waiting for the RayCluster".
The answer is usually on a pod: the scheduler's Unschedulable condition, or a container waiting on
ImagePullBackOff or CrashLoopBackOff. KubeRay's own status says none of it (kuberay#4178).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlhf_api.model_source import FETCH_CONTAINER

# Container waiting reasons that mean "will not start without a change", worst first.
WAITING_REASONS = (
    "InvalidImageName",
    "ErrImageNeverPull",
    "ImagePullBackOff",
    "ErrImagePull",
    "CreateContainerConfigError",
    "CreateContainerError",
    "CrashLoopBackOff",
    "RunContainerError",
)


@dataclass(frozen=True)
class PodProblem:
    reason: str  # Unschedulable, ImagePullBackOff, ...
    pod: str
    message: str

    def describe(self) -> str:
        return f"pod {self.pod}: {self.reason}: {self.message}".rstrip(": ")


def _waiting(pod: dict[str, Any]) -> PodProblem | None:
    status = pod.get("status") or {}
    found: list[PodProblem] = []
    for cs in [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        reason = str(waiting.get("reason") or "")
        if reason in WAITING_REASONS:
            message = " ".join(str(waiting.get("message") or "").split())
            found.append(
                PodProblem(reason, pod["metadata"]["name"], f"container {cs.get('name')}: {message}")
            )
    return min(found, key=lambda p: WAITING_REASONS.index(p.reason)) if found else None


def _unschedulable(pod: dict[str, Any]) -> PodProblem | None:
    for c in (pod.get("status") or {}).get("conditions") or []:
        if (
            c.get("type") == "PodScheduled"
            and c.get("status") == "False"
            and c.get("reason") == "Unschedulable"
        ):
            message = " ".join(str(c.get("message") or "").split())
            return PodProblem("Unschedulable", pod["metadata"]["name"], message)
    return None


def diagnose(pods: list[dict[str, Any]]) -> PodProblem | None:
    """The first problem found, container failures before scheduling (they need a fix, scheduling may
    only need time), then by pod name so the answer is stable across rounds."""
    ordered = sorted(pods, key=lambda p: str(p.get("metadata", {}).get("name", "")))
    for check in (_waiting, _unschedulable):
        for pod in ordered:
            problem = check(pod)
            if problem is not None:
                return problem
    return None


def _fetch_step(cs: dict[str, Any]) -> dict[str, Any]:
    """The head's fetch-models step as ModelsReady reads it (rlhf_operator.model_fetch): which state it is
    in, and a finished run's exit code and termination message (its bytes, or its failure's reason), now
    and before a restart."""

    def slim(state: dict[str, Any] | None) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for kind, value in (state or {}).items():
            keep = ("exitCode", "message", "reason") if kind in ("terminated", "waiting") else ()
            out[kind] = {k: value[k] for k in keep if k in (value or {})}
        return out

    return {
        "name": cs.get("name"),
        "state": slim(cs.get("state")),
        "lastState": slim({k: v for k, v in (cs.get("lastState") or {}).items() if k == "terminated"}),
    }


def slim_pod(pod: dict[str, Any]) -> dict[str, Any]:
    """A pod with only what `diagnose` and `scaling.engines_pending` read: its name, namespace, labels and
    deletion; its phase, its conditions' type, status, reason and message, and its containers' waiting
    state. The operator keeps every job pod this way (a watch cache), so the rest is left out."""
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    slim_status: dict[str, Any] = {"phase": status.get("phase")}
    conditions = [
        {k: c[k] for k in ("type", "status", "reason", "message") if k in c}
        for c in status.get("conditions") or []
    ]
    if conditions:
        slim_status["conditions"] = conditions
    for key in ("initContainerStatuses", "containerStatuses"):
        containers = [
            _fetch_step(cs)
            if cs.get("name") == FETCH_CONTAINER
            else {"name": cs.get("name"), "state": {"waiting": waiting}}
            if (waiting := (cs.get("state") or {}).get("waiting"))
            else {"name": cs.get("name")}
            for cs in status.get(key) or []
        ]
        if containers:
            slim_status[key] = containers
    return {
        "metadata": {
            "name": meta.get("name"),
            "namespace": meta.get("namespace"),
            "labels": dict(meta.get("labels") or {}),
            "deletionTimestamp": meta.get("deletionTimestamp"),
        },
        "status": slim_status,
    }


def rejection_is_permanent(code: int | None, message: str) -> bool:
    """Whether the API server's refusal to create a RayCluster will repeat as long as the job is the same.

    400 and 422 (invalid, or denied by an admission policy) and 403 (forbidden by a webhook, policy or
    RBAC) are permanent. A 403 from a ResourceQuota is not (exceeded, or not yet calculated): quota frees
    up as other jobs end.
    404 (no RayCluster CRD: KubeRay not installed yet), 409 handled by the caller, 429 and 5xx retry.
    """
    if code in (400, 422):
        return True
    if code == 403:
        return "quota" not in message.lower()
    return False
