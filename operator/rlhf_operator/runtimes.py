"""A job's runtime, bound once: the first time the operator sees a job that names a runtime, it reads the
runtime, checks it, copies its spec into an immutable ConfigMap the job owns (`<job>-runtime`), and makes
the per-job checkpoint claim its template asks for. From then on the job is merged with that copy, never
with the live runtime: editing a runtime changes no running job, and a restarted attempt uses the
generation the job started with (docs/runtimes.md). The copy is kept in memory (JobState.runtime) after
its first read; a process restart reads it back once per job.

Errors that no retry can fix (the runtime is missing or invalid) come back as text for the job's Failed
status; anything else the API server says is raised for the caller's retry.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any, cast

import kopf
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError
from rlhf_api import runtime_merge
from rlhf_api.runtime_spec import (
    CLUSTER_KIND,
    CLUSTER_PLURAL,
    NAMESPACED_PLURAL,
    RLHFRuntimeSpec,
    runtime_violations,
)
from rlhf_api.spec import GROUP, VERSION

from rlhf_operator import kube, manifests, runtime

log = logging.getLogger("rlhf_operator")
SNAPSHOT_KEY = "runtime.json"
# The job condition saying which runtime it runs on, or why it could not (reason RuntimeNotFound, ...).
CONDITION = "RuntimeBound"


@dataclass(frozen=True)
class Bound:
    """The runtime a job is merged with, as it was when the job was bound to it."""

    kind: str
    name: str
    generation: int
    spec: RLHFRuntimeSpec
    configmap: str

    @property
    def ref(self) -> str:
        return f"{self.kind}/{self.name}"

    def status(self, checkpoint_claim: str | None) -> dict[str, Any]:
        """status.runtime."""
        out: dict[str, Any] = {
            "kind": self.kind,
            "name": self.name,
            "generation": self.generation,
            "snapshot": self.configmap,
        }
        if checkpoint_claim:
            out["checkpointClaim"] = checkpoint_claim
        return out


class RuntimeUnusable(Exception):
    """A runtime problem no retry fixes; its text goes into the job's Failed status."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


def snapshot_name(job: str) -> str:
    return f"{job}-runtime"


def bound(body: kopf.Body) -> Bound | None:
    """The job's runtime (None when it names none), binding it on first use. Raises RuntimeUnusable for a
    missing or invalid runtime, ApiException for anything transient."""
    ref = body.spec.get("runtimeRef")
    if not ref:
        return None
    state = runtime.state_of(body)
    if isinstance(state.runtime, RuntimeUnusable):  # it failed the job: not asked again each round
        raise state.runtime
    if state.runtime is not None:
        return cast(Bound, state.runtime)
    namespace, job = body.metadata.namespace or "default", body.metadata.name or ""
    kind, name = str(ref.get("kind") or CLUSTER_KIND), str(ref.get("name") or "")
    result = _read_snapshot(namespace, job, body.metadata.uid or "")
    if result is None:
        result = _bind(body, namespace, job, kind, name)
    state.runtime = result
    return result


def _read_snapshot(namespace: str, job: str, uid: str) -> Bound | None:
    try:
        cm = k8s.CoreV1Api(kube.api()).read_namespaced_config_map(snapshot_name(job), namespace)
    except ApiException as e:
        if e.status == 404:
            return None
        raise
    owners = [o.uid for o in ((cm.metadata.owner_references if cm.metadata else None) or [])]
    if uid not in owners:  # a leftover of an earlier job of the same name: not this job's
        raise RuntimeUnusable(
            "RuntimeSnapshotConflict",
            f"ConfigMap {snapshot_name(job)} exists and belongs to another object: delete it and re-create the job",
        )
    data = json.loads((cm.data or {})[SNAPSHOT_KEY])
    return Bound(
        data["kind"], data["name"], int(data["generation"]), RLHFRuntimeSpec.model_validate(data["spec"]),
        snapshot_name(job),
    )  # fmt: skip


def _bind(body: kopf.Body, namespace: str, job: str, kind: str, name: str) -> Bound:
    obj = _read_runtime(namespace, kind, name)
    where = f"{kind}/{name}" + ("" if kind == CLUSTER_KIND else f" in namespace {namespace}")
    if obj is None:
        raise RuntimeUnusable(
            "RuntimeNotFound", f"spec.runtimeRef: {where} does not exist (kubectl get {kind.lower()})"
        )
    try:
        spec = RLHFRuntimeSpec.model_validate(obj.get("spec") or {})
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(x) for x in first["loc"])
        raise RuntimeUnusable("RuntimeInvalid", f"{where}: spec.{loc}: {first['msg']}") from e
    broken = runtime_violations(spec)
    if broken:
        raise RuntimeUnusable("RuntimeInvalid", f"{where}: spec.{broken[0].field}: {broken[0].message}")
    meta = obj.get("metadata") or {}
    bound_ = Bound(kind, name, int(meta.get("generation") or 1), spec, snapshot_name(job))
    _write_snapshot(body, namespace, job, bound_)
    return bound_


def _read_runtime(namespace: str, kind: str, name: str) -> dict[str, Any] | None:
    try:
        if kind == CLUSTER_KIND:
            got = kube.custom().get_cluster_custom_object(GROUP, VERSION, CLUSTER_PLURAL, name)
        else:
            got = kube.custom().get_namespaced_custom_object(
                GROUP, VERSION, namespace, NAMESPACED_PLURAL, name
            )
    except ApiException as e:
        if e.status == 404:
            return None
        raise
    return cast(dict[str, Any], got)


def _write_snapshot(body: kopf.Body, namespace: str, job: str, b: Bound) -> None:
    data = {
        "kind": b.kind,
        "name": b.name,
        "generation": b.generation,
        "spec": b.spec.model_dump(mode="json", exclude_none=True),
    }
    cm: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": b.configmap, "labels": {manifests.JOB_LABEL: job}},
        "immutable": True,
        "data": {SNAPSHOT_KEY: json.dumps(data, sort_keys=True)},
    }
    kopf.adopt(cm, owner=body)
    try:
        k8s.CoreV1Api(kube.api()).create_namespaced_config_map(namespace, cm)  # type: ignore[arg-type]
    except ApiException as e:
        if e.status != 409:
            raise
        # Made by an earlier incarnation of this operator between its read and now: that one holds.
        return
    log.info(
        "%s/%s: bound to %s generation %d (snapshot %s)", namespace, job, b.ref, b.generation, b.configmap
    )


def ensure_claim(body: kopf.Body, b: Bound) -> str | None:
    """The per-job checkpoint claim of the runtime's template, created if missing; its name, or None."""
    template = b.spec.storage.claim_template() if b.spec.storage else None
    if template is None:
        return None
    namespace, job = body.metadata.namespace or "default", body.metadata.name or ""
    state = runtime.state_of(body)
    name = runtime_merge.claim_name(job)
    if state.claim_ensured:
        return name
    spec: dict[str, Any] = {
        "accessModes": list(template.access_modes),
        "resources": {"requests": {"storage": str(template.size)}},
    }
    if template.storage_class_name:
        spec["storageClassName"] = template.storage_class_name
    claim: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {
            "name": name,
            "labels": {manifests.JOB_LABEL: job, "rlhf.dev/when-job-deleted": template.when_job_deleted},
        },
        "spec": spec,
    }
    if template.when_job_deleted == "Delete":
        kopf.adopt(claim, owner=body)  # the garbage collector deletes it with the job
    if _create_claim(namespace, claim):
        kopf.event(body, type="Normal", reason="CheckpointClaimCreated", message=f"created claim {name}")
    state.claim_ensured = True
    return name


def _create_claim(namespace: str, claim: dict[str, Any]) -> bool:
    """Create the claim; False when it exists already (an earlier incarnation's, or a retained one)."""
    try:
        k8s.CoreV1Api(kube.api()).create_namespaced_persistent_volume_claim(namespace, claim)  # type: ignore[arg-type]
    except ApiException as e:
        if e.status != 409:
            raise
        return False
    return True
