"""Spec -> KubeRay RayCluster manifest, and the trainer's Ray job entrypoint. Pure functions.

Must not call the Kubernetes API or import kopf: handlers feed these functions and do the I/O.
Sizing: one `trainer` worker group (one pod per node of every GPU group, each pod with the largest
gpusPerNode) and one `rollout` group (one pod per `gpusPerWorker` GPUs of engines x TP).
"""

from __future__ import annotations

import copy
import hashlib
import json
import shlex
from typing import Any

from rlhf_api import pod_settings
from rlhf_api.constants import (
    DEFAULT_TRAINER_IMAGE,
    GPU_STANDIN_ENV,
    JOB_NAME_ENV,
    METRICS_PORT_ENV,
    NAMESPACE_ENV,
    POD_SLOTS_ENV,
    ROLE_ENV,
    ROLLOUT_RESOURCE,
    S3_CREDENTIAL_KEYS,
    S3_OPTIONAL_KEYS,
    SHUTDOWN_MARGIN_SECONDS,
    SPEC_JSON_ENV,
    STOP_BUDGET_ENV,
    TRAINER_RESOURCE,
)
from rlhf_api.model_source import FETCH_CONTAINER, parse_source
from rlhf_api.pod_settings import PodRole
from rlhf_api.pod_shape import trainer_pods
from rlhf_api.spec import GROUP, PodSettings, RLHFJob, RLHFJobSpec, scaled_quantity

from rlhf_operator import kueue, security, tracking
from rlhf_operator.scaling import clamp_request

JOB_LABEL = f"{GROUP}/job"
ROLE_LABEL = f"{GROUP}/role"
MANAGED_BY = {"app.kubernetes.io/managed-by": "rlhf-operator"}
SHM_VOLUME = "rlhf-dev-shm"
MODEL_CACHE_VOLUME = "rlhf-model-cache"
DASHBOARD_PORT = security.DASHBOARD_PORT
# Labels of the job that are never copied to children (they describe the RLHFJob object itself).
_NOT_PROPAGATED_PREFIXES = ("kopf.zalando.org/",)


def raycluster_name(job_name: str) -> str:
    """Deterministic, so a restarted operator finds the cluster it created instead of making a second one.

    KubeRay derives pod and service names from it; keep it short enough for the 63-character limits.
    """
    if len(job_name) <= 40:
        return job_name
    digest = hashlib.sha256(job_name.encode()).hexdigest()[:6]
    return f"{job_name[:33].rstrip('-')}-{digest}"


def head_url(raycluster: dict[str, Any] | None, port: int, dev_host: str = "") -> str:
    """`http://HOST:PORT` on a RayCluster's head: KubeRay's head Service (`status.head.serviceName`, else
    `<name>-head-svc`) in the cluster's namespace, or `dev_host` when set (the development override,
    docs/development.md), which needs no cluster object."""
    if dev_host:
        return f"http://{dev_host}:{port}"
    if raycluster is None:
        raise ValueError("head_url: no RayCluster and no development head host")
    meta = raycluster["metadata"]
    service = (raycluster.get("status") or {}).get("head", {}).get(
        "serviceName"
    ) or f"{meta['name']}-head-svc"
    return f"http://{service}.{meta['namespace']}.svc:{port}"


def _child_metadata(job: RLHFJob, name: str) -> dict[str, Any]:
    """Metadata of an object the job owns: its name, the job's labels, the job's namespace."""
    metadata: dict[str, Any] = {"name": name, "labels": child_labels(job)}
    if job.namespace:
        metadata["namespace"] = job.namespace
    return metadata


def child_labels(job: RLHFJob) -> dict[str, str]:
    labels = {
        k: str(v)
        for k, v in (job.metadata.get("labels") or {}).items()
        if not k.startswith(_NOT_PROPAGATED_PREFIXES)
    }
    labels.update(MANAGED_BY)
    labels[JOB_LABEL] = job.name
    return labels


def effective_engines(spec: RLHFJobSpec) -> int:
    """Engines to run: spec.rollout.engines clamped to the autoscaling range when autoscaling is on
    (scaling.clamp_request, the one definition of that clamp)."""
    engines, _ = clamp_request(spec.rollout.engines, spec.rollout.autoscaling)
    return engines


def rollout_replicas(spec: RLHFJobSpec, engines: int | None = None) -> int:
    """Rollout worker pods; zero when every model is colocated with the engines on the trainer pods."""
    if spec.trainer.colocate_all:
        return 0
    return spec.rollout.replicas(effective_engines(spec) if engines is None else engines)


def _resources(settings: PodSettings, gpus: int) -> dict[str, Any]:
    """The container's resources: `resourcesPerGpu` times the pod's GPUs, under `resources`, and the GPUs."""
    base, per_gpu = settings.resources, settings.resources_per_gpu
    requests = dict((base.requests if base else None) or {})
    limits = dict((base.limits if base else None) or {})
    if gpus and per_gpu is not None:
        for scaled, given in ((requests, per_gpu.requests), (limits, per_gpu.limits)):
            for key, value in (given or {}).items():
                scaled.setdefault(key, scaled_quantity(value, gpus))
    if gpus:
        requests[pod_settings.gpu_resource(settings)] = str(gpus)
        limits[pod_settings.gpu_resource(settings)] = str(gpus)
    out: dict[str, Any] = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def _pod_template(
    job: RLHFJob, role: PodRole, gpus: int, ports: list[dict[str, Any]], default_image: str
) -> dict[str, Any]:
    spec = job.spec
    pods = pod_settings.for_role(spec.pods, role)
    pod_security, container_security = pod_settings.security_contexts(pods)
    # Ray's object store lives in /dev/shm, and the runtime's 64 MiB default is far too small: a
    # memory-backed emptyDir, unless the job mounts its own there.
    own_shm = any(m.get("mountPath") == "/dev/shm" for m in pods.volume_mounts or [])
    shm_mount = [] if own_shm else [{"name": SHM_VOLUME, "mountPath": "/dev/shm"}]
    shm_volume = [] if own_shm else [{"name": SHM_VOLUME, "emptyDir": {"medium": "Memory"}}]
    resources = _resources(pods, gpus)
    cache_volume, cache_mount = model_cache_volume(spec, pods)
    container = _container(
        job, role, pods, resources, ports, default_image, container_security, [*shm_mount, *cache_mount]
    )
    pod_spec: dict[str, Any] = {
        # No Docker-link variables for every Service of the namespace: nothing here reads them.
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": spec.run_policy.termination_grace_period_seconds,
        "containers": [container],
        "securityContext": pod_security,
        "volumes": [*shm_volume, *cache_volume, *(pods.volumes or [])],
        **_placement(job, role, pods),
    }
    fetch = fetch_models_container(job, container) if role == "head" else None
    if fetch is not None:
        pod_spec["initContainers"] = [fetch]
    if pods.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": s.name} for s in pods.image_pull_secrets]
    labels = {**child_labels(job), **(pods.labels or {}), ROLE_LABEL: role}
    metadata: dict[str, Any] = {"labels": labels}
    if pods.annotations:
        metadata["annotations"] = dict(pods.annotations)
    # Each template owns its objects: none shared with the spec, another role or the module's defaults.
    return copy.deepcopy({"metadata": metadata, "spec": pod_spec})


def _container(
    job: RLHFJob,
    role: PodRole,
    pods: PodSettings,
    resources: dict[str, Any],
    ports: list[dict[str, Any]],
    default_image: str,
    security_context: dict[str, Any],
    shm_mount: list[dict[str, Any]],
) -> dict[str, Any]:
    """The role's Ray container."""
    env = [
        {"name": JOB_NAME_ENV, "value": job.name},
        {"name": ROLE_ENV, "value": role},
        {"name": STOP_BUDGET_ENV, "value": str(stop_budget_seconds(job))},
        *security.auth_env(job),
        *storage_env(job),
        *(tracking.head_env(job.spec) if role == "head" else []),
        *(pods.env or []),
    ]
    container: dict[str, Any] = {
        "name": "ray-head" if role == "head" else "ray-worker",
        "image": job.spec.image or default_image,
        "env": env,
        "securityContext": security_context,
        "volumeMounts": [*shm_mount, *(pods.volume_mounts or [])],
    }
    if pods.env_from:
        container["envFrom"] = list(pods.env_from)
    if resources:
        container["resources"] = resources
    if ports:
        container["ports"] = ports
    if role == "head":
        # The driver is a child of Ray's job supervisor, not PID 1, so the kubelet's SIGTERM never reaches
        # it: the hook passes it on and waits (within the grace period) for its checkpoint and exit.
        container["lifecycle"] = {"preStop": {"exec": {"command": ["python", "-m", "rlhf_trainer.preempt"]}}}
    elif role == "rollout":
        # A rollout pod being deleted (a scale-down, an eviction) tells Ray first: the hook drains its node
        # until the grace period ends, and the trainer retires the engine on it between phases instead of
        # losing it at the kill, perhaps mid weight sync (rlhf_trainer.drain).
        grace = str(job.spec.run_policy.termination_grace_period_seconds)
        drain = ["python", "-m", "rlhf_trainer.drain", "--deadline-seconds", grace]
        container["lifecycle"] = {"preStop": {"exec": {"command": drain}}}
    return container


def storage_env(job: RLHFJob) -> list[dict[str, Any]]:
    """The object store's credentials as env entries read from spec.storage.s3's Secret by the kubelet:
    the names boto3 and pyarrow read, the values never in any manifest. Every container of the job gets
    them, and Ray's workers and the driver inherit them from the raylet their container started."""
    s3 = job.spec.storage.s3
    if s3 is None:
        return []
    keys = [(key, False) for key in S3_CREDENTIAL_KEYS] + [(key, True) for key in S3_OPTIONAL_KEYS]
    return [
        {
            "name": key,
            "valueFrom": {"secretKeyRef": {"name": s3.credentials_secret, "key": key, "optional": optional}},
        }
        for key, optional in keys
    ]


def remote_models(spec: RLHFJobSpec) -> dict[str, str]:
    """The loaded models that come from `hf://` or `s3://`, by spec field: what the fetch step fetches."""
    return {field: uri for field, uri in spec.model_sources().items() if parse_source(uri).remote}


def model_cache_volume(
    spec: RLHFJobSpec, pods: PodSettings
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The model cache's claim as a pod volume and its mount (in every container of the job, so every
    rank loads a fetched model from the same path), or nothing without storage.modelCache, or when the
    pods already mount something there (a runtime's model cache volume, the job's own mount)."""
    cache = spec.storage.model_cache
    if cache is None or any(m.get("mountPath") == cache.mount_path for m in pods.volume_mounts or []):
        return [], []
    volume = {"name": MODEL_CACHE_VOLUME, "persistentVolumeClaim": {"claimName": cache.claim_name}}
    return [volume], [{"name": MODEL_CACHE_VOLUME, "mountPath": cache.mount_path}]


def fetch_models_container(job: RLHFJob, head: dict[str, Any]) -> dict[str, Any] | None:
    """The head pod's init container that fetches the job's remote models into the cache before Ray (and
    so the trainer) starts: the head container's image, security context, resources, env and mounts,
    plus the Hub token from storage.huggingFace.tokenSecret (this container only; never in a manifest).
    None when every model is a path. Progress and failure reach the operator through its log and its
    termination message (rlhf_operator.model_fetch)."""
    spec = job.spec
    sources = remote_models(spec)
    if not sources or spec.storage.model_cache is None:
        return None
    args = ["python", "-m", "rlhf_trainer.fetch_models", "--cache", spec.storage.model_cache.mount_path]
    for field, uri in sources.items():
        args += ["--source", f"{field}={uri}"]
    hub = spec.storage.hugging_face
    token: list[dict[str, Any]] = (
        [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": hub.token_secret, "key": "HF_TOKEN"}}}]
        if hub is not None and hub.token_secret
        else []
    )
    # huggingface_hub's own cache and lock files go to the cache volume: the root file system is read-only.
    hf_home = {"name": "HF_HOME", "value": f"{spec.storage.model_cache.mount_path}/.hf-home"}
    container: dict[str, Any] = {
        "name": FETCH_CONTAINER,
        "image": head["image"],
        "command": args,
        "env": [*head["env"], hf_home, *token],
        "securityContext": head["securityContext"],
        "volumeMounts": head["volumeMounts"],
        "terminationMessagePolicy": "File",
        **{key: head[key] for key in ("envFrom", "resources") if key in head},
    }
    return copy.deepcopy(container)  # shares nothing with the head container


def _placement(job: RLHFJob, role: PodRole, pods: PodSettings) -> dict[str, Any]:
    """Where the role's pods go and who runs them: node selector, tolerations, affinity (rollout pods
    spread by default), service account, priority class, scheduler."""
    out: dict[str, Any] = {}
    if pods.node_selector:
        out["nodeSelector"] = dict(pods.node_selector)
    if pods.tolerations:
        out["tolerations"] = list(pods.tolerations)
    if pods.affinity:
        out["affinity"] = dict(pods.affinity)
    elif role == "rollout":
        out["affinity"] = _spread_rollout_pods(job)
    for key, value in (
        ("serviceAccountName", pods.service_account_name),
        ("priorityClassName", pods.priority_class_name),
        ("schedulerName", pods.scheduler_name),
    ):
        if value:
            out[key] = value
    return out


def _spread_rollout_pods(job: RLHFJob) -> dict[str, Any]:
    """Prefer one rollout pod per node, so losing a node takes one engine's share, not all of them.

    Preferred, not required: a cluster with fewer nodes than engines still schedules every pod.
    """
    selector = {**child_labels(job), ROLE_LABEL: "rollout"}
    return {
        "podAntiAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {
                    "weight": 100,
                    "podAffinityTerm": {
                        "labelSelector": {"matchLabels": selector},
                        "topologyKey": "kubernetes.io/hostname",
                    },
                }
            ]
        }
    }


def _ray_resources(name: str, amount: int) -> str:
    """`rayStartParams.resources`: KubeRay pastes each value into a bash command line unquoted
    (` --resources=VALUE `), so the JSON object goes in single quotes, as KubeRay writes it itself."""
    return f"'{json.dumps({name: amount})}'"


def _worker_params(resource: str, amount: int, gpus: int) -> dict[str, str]:
    """A worker group's `rayStartParams`: its custom resource, and its GPUs as Ray's `num-gpus`, set from
    the job (KubeRay would infer them only from resource names it knows; a MIG slice's is not one)."""
    return {"resources": _ray_resources(resource, amount), "num-gpus": str(gpus)}


def build_raycluster(
    job: RLHFJob, engines: int | None = None, default_image: str = DEFAULT_TRAINER_IMAGE
) -> dict[str, Any]:
    """The RayCluster for a job. `engines` overrides the spec (the operator's clamped/scaled value);
    `default_image` is the trainer image of a job that names none (the operator's configured default)."""
    spec = job.spec
    n_trainer, trainer_gpus = trainer_pods(spec)
    n_rollout = rollout_replicas(spec, engines)
    head_ports = [
        {"name": "gcs-server", "containerPort": 6379},
        {"name": "dashboard", "containerPort": DASHBOARD_PORT},
        {"name": "client", "containerPort": 10001},
        {"name": "rlhf-metrics", "containerPort": spec.monitoring.metrics_port},
    ]
    worker_groups: list[dict[str, Any]] = [
        {
            "groupName": "trainer",
            "replicas": n_trainer,
            "minReplicas": n_trainer,
            "maxReplicas": n_trainer,
            "rayStartParams": _worker_params(TRAINER_RESOURCE, trainer_gpus, trainer_gpus),
            "template": _pod_template(job, "trainer", trainer_gpus, [], default_image),
        }
    ]
    if not spec.trainer.colocate_all:
        r = spec.rollout
        max_engines = r.autoscaling.max_engines if r.autoscaling.enabled else max(r.engines, n_rollout)
        worker_groups.append(
            {
                "groupName": "rollout",
                "replicas": n_rollout,
                "minReplicas": 0,
                "maxReplicas": max(n_rollout, r.replicas(max_engines)),
                "rayStartParams": _worker_params(ROLLOUT_RESOURCE, r.engines_per_worker, r.worker_gpus),
                "template": _pod_template(job, "rollout", r.worker_gpus, [], default_image),
            }
        )
    metadata = _child_metadata(job, raycluster_name(job.name))
    if kueue.QUEUE_LABEL in metadata["labels"] and not spec.trainer.colocate_all:
        # Asks Kueue for an elastic workload, so the rollout group may scale while admitted; inert unless
        # Kueue's ElasticJobsViaWorkloadSlices gate is on (kueue.elastic tells from the cluster).
        metadata["annotations"] = {kueue.ELASTIC_ANNOTATION: "true"}
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayCluster",
        "metadata": metadata,
        "spec": {
            "rayVersion": spec.ray_version,
            "suspend": spec.run_policy.suspend,
            "headGroupSpec": {
                # The head runs the driver only: no GPUs, no training work scheduled on it.
                "rayStartParams": {"dashboard-host": "0.0.0.0", "num-gpus": "0"},
                "template": _pod_template(job, "head", 0, head_ports, default_image),
            },
            "workerGroupSpecs": worker_groups,
        },
    }


def job_selector(job: RLHFJob) -> dict[str, str]:
    """Selects every pod of the job (each carries child_labels), and nothing else the operator makes."""
    return {JOB_LABEL: job.name, **MANAGED_BY}


def security_objects(job: RLHFJob, token_key: bytes, access: security.PolicyAccess) -> list[dict[str, Any]]:
    """What must exist before the job's RayCluster: the Secret with its Ray token (when token
    authentication is on) and its NetworkPolicy (when enabled). Owner references are the caller's."""
    objects: list[dict[str, Any]] = []
    if security.token_enabled(job):
        metadata = _child_metadata(job, security.token_secret_name(job))
        objects.append(security.token_secret(metadata, security.token_of(token_key, job)))
    if job.spec.security.network_policy == "Enabled":
        metadata = _child_metadata(job, raycluster_name(job.name))
        objects.append(security.network_policy(job, metadata, job_selector(job), access))
    return objects


def scale_patch(raycluster: dict[str, Any], replicas: int) -> list[dict[str, Any]] | None:
    """JSON patch setting the rollout group's replicas (and raising maxReplicas if needed), or None."""
    for i, group in enumerate(raycluster.get("spec", {}).get("workerGroupSpecs", [])):
        if group.get("groupName") != "rollout":
            continue
        ops: list[dict[str, Any]] = []
        if int(group.get("replicas", 0)) != replicas:
            ops.append({"op": "replace", "path": f"/spec/workerGroupSpecs/{i}/replicas", "value": replicas})
        if int(group.get("maxReplicas", 0)) < replicas:
            ops.append(
                {"op": "replace", "path": f"/spec/workerGroupSpecs/{i}/maxReplicas", "value": replicas}
            )
        return ops or None
    return None


def submission_id(job: RLHFJob, uid: str, attempt: int, preemptions: int = 0) -> str:
    """One id per (job, attempt, admission): a resubmit after an operator crash finds the same Ray job,
    and a readmitted job's is new (a Ray head that outlived the eviction still knows the stopped one)."""
    base = f"rlhf-{job.namespace or 'default'}-{job.name}-{uid[:8]}-{attempt}"
    return f"{base}-p{preemptions}" if preemptions else base


def previous_submission_ids(job: RLHFJob, uid: str, attempt: int, preemptions: int) -> list[str]:
    """The ids the attempt before this one may have had: one restart or one readmission ago."""
    earlier = [(attempt - 1, preemptions), (attempt, preemptions - 1)]
    return [submission_id(job, uid, a, p) for a, p in earlier if a >= 0 and p >= 0]


def stop_budget_seconds(job: RLHFJob) -> int:
    """How long the trainer has to stop when told to: the pods' grace period less their own shutdown."""
    return max(1, job.spec.run_policy.termination_grace_period_seconds - SHUTDOWN_MARGIN_SECONDS)


def trainer_entrypoint(job: RLHFJob) -> str:
    return " ".join(
        shlex.quote(a)
        for a in [
            "python",
            "-m",
            "rlhf_trainer.driver",
            "--job-name",
            job.name,
            "--spec-env",
            SPEC_JSON_ENV,
        ]
    )


def trainer_runtime_env(
    job: RLHFJob, extra_env: dict[str, str] | None = None, gpu_standin: str = "", pod_slots: bool = False
) -> dict[str, Any]:
    """The Ray job's runtime env: the spec, the job's identity, `spec.pods.env`'s literal values, and the
    operator's GPU stand-in setting (`RLHF_GPU_STANDIN`, which a job's own env may override), and, for a
    job in its own RayCluster (`pod_slots`), that its pods advertise their role's slots (`RLHF_POD_SLOTS`).

    The pods' env also reaches every Ray actor this way (Ray workers do not inherit a container's env
    when their raylet was started elsewhere), and under the dev override, where the pods are KWOK's and
    the trainer runs on a local Ray head. `valueFrom` entries exist only in the pods.
    """
    literal = {
        str(e["name"]): str(e["value"]) for e in (job.spec.pods.env or []) if "name" in e and "value" in e
    }
    env = {
        **({GPU_STANDIN_ENV: gpu_standin} if gpu_standin else {}),
        **({POD_SLOTS_ENV: "1"} if pod_slots else {}),
        **literal,
        SPEC_JSON_ENV: job.spec.model_dump_json(by_alias=True, exclude_none=True),
        JOB_NAME_ENV: job.name,
        NAMESPACE_ENV: job.namespace,
        METRICS_PORT_ENV: str(job.spec.monitoring.metrics_port),
        STOP_BUDGET_ENV: str(stop_budget_seconds(job)),
        # Ray's job supervisor reads this for a stop (SIGTERM, then SIGKILL after it): the trainer's budget.
        "RAY_JOB_STOP_WAIT_TIME_S": str(stop_budget_seconds(job)),
        **(extra_env or {}),
    }
    return {"env_vars": env}
