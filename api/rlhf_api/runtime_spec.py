"""The platform's runtimes, `ClusterRLHFRuntime` (cluster-scoped) and `RLHFRuntime` (namespaced), as one
typed model beside the RLHFJob's: what the platform team owns (images, per-role pods, the NCCL fabric,
storage, defaults of any job field) and which job fields a job may set over them. `runtime_merge.py`
merges a runtime under a job; `crd.py` generates both CRDs from this file. Pure: pydantic and the spec.
"""

from __future__ import annotations

from typing import Final, Literal

from pydantic import BaseModel, Field, field_validator

from rlhf_api.rules import Rule
from rlhf_api.spec import API_VERSION, KubeObject, PodsSpec, Quantity, Resource, RLHFJobSpec, _Spec

CLUSTER_KIND: Final = "ClusterRLHFRuntime"
NAMESPACED_KIND: Final = "RLHFRuntime"
CLUSTER_PLURAL: Final = "clusterrlhfruntimes"
NAMESPACED_PLURAL: Final = "rlhfruntimes"
# The job fields a runtime lets jobs set when it names none: the experiment, not the infrastructure
# (image, rayVersion, pods, security and the volumes stay the runtime's; the job names the Secrets of its
# own object store and Hub account). `runtimeRef` is always the job's.
DEFAULT_OVERRIDABLE: Final[tuple[str, ...]] = (
    "model",
    "data",
    "algorithm",
    "trainer",
    "rollout",
    "weightSync",
    "checkpoint",
    "monitoring",
    "runPolicy",
    "evaluation",
    "tracking",
    "storage.s3",
    "storage.huggingFace",
)
ABSOLUTE_PATH = r"^/.*"
AccessMode = Literal["ReadWriteOnce", "ReadWriteOncePod", "ReadWriteMany"]
# Job fields a runtime gives by fields of its own (images, rayVersion, pods), not by jobDefaults; and the
# job's own reference to it.
NOT_IN_JOB_DEFAULTS: Final = ("image", "rayVersion", "pods", "runtimeRef")
# The volume names a runtime's storage takes in every pod (a job's own volumes must not reuse them).
MODEL_CACHE_VOLUME: Final = "model-cache"
CHECKPOINTS_VOLUME: Final = "checkpoints"


class RuntimeImages(_Spec):
    """The trainer image in its two flavours (trainer_image/Dockerfile): the operator picks by whether the
    job asks for GPUs."""

    cpu: str | None = Field(
        default=None,
        min_length=1,
        description="Image of jobs that ask for no GPUs (and of the CPU stand-in).",
    )
    gpu: str | None = Field(default=None, min_length=1, description="Image of jobs whose pods get GPUs.")


def _read_write_many() -> list[AccessMode]:
    return ["ReadWriteMany"]


class ClaimTemplate(_Spec):
    """A PersistentVolumeClaim made for each job (named `<job>-<volume>`), so that no two jobs share it."""

    storage_class_name: str | None = Field(
        default=None, min_length=1, description="StorageClass of the claim (unset: the cluster's default)."
    )
    size: Quantity = Field(description="Requested size, e.g. 500Gi.")
    access_modes: list[AccessMode] = Field(
        default_factory=_read_write_many,
        min_length=1,
        description="Access modes (ReadWriteMany: pods on several nodes write checkpoints to it).",
    )
    when_job_deleted: Literal["Delete", "Retain"] = Field(
        default="Delete",
        description="Delete: the claim is owned by the job and goes with it. Retain: it outlives the job; "
        "a later job of the same name and namespace takes it over and resumes from its checkpoints.",
    )


class RuntimeVolume(_Spec):
    """A volume every pod of the job mounts at the same path: an existing claim, or a claim per job."""

    mount_path: str = Field(pattern=ABSOLUTE_PATH, description="Where every pod mounts it.")
    claim_name: str | None = Field(
        default=None,
        min_length=1,
        description="An existing PersistentVolumeClaim in the job's namespace, shared by the jobs that use "
        "this runtime (each writes checkpoints under <mountPath>/<namespace>/<job>).",
    )
    claim_template: ClaimTemplate | None = Field(
        default=None, description="A claim made for each job from this template (checkpoints only)."
    )
    read_only: bool = Field(default=False, description="Mount it read-only (a shared model cache).")


class RuntimeStorage(_Spec):
    """Volumes mounted the same way in every pod of every job on the runtime."""

    model_cache: RuntimeVolume | None = Field(
        default=None,
        description="Where models live (the job's model paths point into it); see docs/runtimes.md for sizing.",
    )
    checkpoints: RuntimeVolume | None = Field(
        default=None,
        description="Where checkpoints go: a job that sets no checkpoint.path writes under "
        "<mountPath>/<namespace>/<job>.",
    )

    def volumes(self) -> list[tuple[str, RuntimeVolume]]:
        """The volumes set, each with the name it takes in every pod."""
        named = ((MODEL_CACHE_VOLUME, self.model_cache), (CHECKPOINTS_VOLUME, self.checkpoints))
        return [(name, volume) for name, volume in named if volume is not None]

    def claim_template(self) -> ClaimTemplate | None:
        """The template of the per-job checkpoint claim, if the checkpoints get one."""
        return self.checkpoints.claim_template if self.checkpoints else None


class RLHFRuntimeSpec(_Spec):
    """What the platform owns of every job that names this runtime."""

    images: RuntimeImages | None = Field(default=None, description="The trainer image, CPU and GPU flavours.")
    ray_version: str | None = Field(default=None, min_length=1, description="Ray version in those images.")
    pods: PodsSpec | None = Field(
        default=None,
        description="Pod settings of every job (spec.pods' shape): pull secrets, service account, per-role "
        "node selectors, tolerations, affinity, priority class, resources per GPU, the GPU resource name, "
        "and the NCCL fabric profile (pods.fabric). A job's own spec.pods, where allowed, merges over them "
        "by spec.pods' rules.",
    )
    storage: RuntimeStorage | None = Field(default=None, description="Model cache and checkpoint volumes.")
    job_defaults: KubeObject | None = Field(
        default=None,
        description="Defaults of any RLHFJob spec field (camelCase, spec's shape, e.g. monitoring, runPolicy, "
        "security): a job's own value wins where `overridable` allows it; elsewhere the runtime's holds.",
    )
    overridable: list[str] | None = Field(
        default=None,
        description="The spec fields (dotted camelCase paths, e.g. algorithm, rollout.engines, "
        "pods.rollout.resources) a job may set; a job setting any other field is refused. Unset: "
        + ", ".join(DEFAULT_OVERRIDABLE)
        + ".",
    )

    @field_validator("overridable")
    @classmethod
    def _known_paths(cls, value: list[str] | None) -> list[str] | None:
        for path in value or []:
            if not spec_path_exists(path):
                raise ValueError(f"{path!r} is not a field of the RLHFJob spec")
        return value

    @field_validator("job_defaults")
    @classmethod
    def _job_fields(cls, value: KubeObject | None) -> KubeObject | None:
        """The same shape the CRD gives jobDefaults: job spec fields, less those the runtime has its own."""
        for key in value or {}:
            if key in NOT_IN_JOB_DEFAULTS:
                raise ValueError(
                    f"{key} is not a job default: use the runtime's own images, rayVersion or pods"
                )
        for path in _paths(value or {}):
            if not spec_path_exists(path):
                raise ValueError(f"{path!r} is not a field of the RLHFJob spec")
        return value

    def allowed(self) -> tuple[str, ...]:
        return tuple(self.overridable) if self.overridable is not None else DEFAULT_OVERRIDABLE


def spec_path_exists(path: str) -> bool:
    """Whether the dotted camelCase `path` names a field of RLHFJobSpec (or of a model or map under it)."""
    model: type[BaseModel] | None = RLHFJobSpec
    for part in path.split("."):
        if model is None:
            return True  # under a map or an open object: any key
        fields = {f.alias or name: f for name, f in model.model_fields.items()}
        if part not in fields:
            return False
        model = _model_of(fields[part].annotation)
    return True


def _paths(tree: KubeObject, prefix: str = "") -> list[str]:
    """The dotted paths of `tree`'s leaves (a leaf: anything but a non-empty mapping)."""
    out = []
    for key, value in tree.items():
        path = f"{prefix}{key}"
        out.extend(_paths(value, path + ".") if isinstance(value, dict) and value else [path])
    return out


def _model_of(annotation: object) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()) or ():
        found = _model_of(arg)
        if found is not None:
            return found
    return None


class _Runtime(Resource):
    api_version: Literal["rlhf.dev/v1alpha1"] = Field(default=API_VERSION, description="rlhf.dev/v1alpha1")
    metadata: KubeObject = Field(default_factory=dict, description="Standard object metadata.")
    spec: RLHFRuntimeSpec = Field(default_factory=RLHFRuntimeSpec, description="What the platform owns.")

    @property
    def name(self) -> str:
        return str(self.metadata.get("name", ""))

    @property
    def generation(self) -> int:
        return int(self.metadata.get("generation") or 1)


class ClusterRLHFRuntime(_Runtime):
    """A runtime every namespace's jobs can name (the platform team's)."""

    kind: Literal["ClusterRLHFRuntime"] = Field(default=CLUSTER_KIND, description=CLUSTER_KIND)


class RLHFRuntime(_Runtime):
    """A runtime of one namespace (a team's own)."""

    kind: Literal["RLHFRuntime"] = Field(default=NAMESPACED_KIND, description=NAMESPACED_KIND)


AnyRuntime = ClusterRLHFRuntime | RLHFRuntime


def _one_claim(volume: RuntimeVolume | None) -> bool:
    return volume is None or ((volume.claim_name is None) != (volume.claim_template is None))


# The runtime's cross-field rules: CEL in both CRDs, Python in `rlhf validate --runtime` (one definition).
RUNTIME_RULES: Final[tuple[Rule, ...]] = (
    Rule(
        name="checkpoints-one-claim",
        scope="storage.checkpoints",
        cel="has(self.claimName) != has(self.claimTemplate)",
        field="storage.checkpoints.claimName",
        message="set exactly one of claimName (an existing claim) and claimTemplate (a claim per job)",
        check=lambda s: s.storage is None or _one_claim(s.storage.checkpoints),
    ),
    Rule(
        name="model-cache-shared-claim",
        scope="storage.modelCache",
        cel="has(self.claimName) && !has(self.claimTemplate)",
        field="storage.modelCache.claimName",
        message="the model cache is an existing claim (claimName) that jobs share; a claim per job "
        "(claimTemplate) would fetch every model again for each job",
        check=lambda s: (
            s.storage is None
            or s.storage.model_cache is None
            or (s.storage.model_cache.claim_name is not None and s.storage.model_cache.claim_template is None)
        ),
    ),
)


def runtime_violations(spec: RLHFRuntimeSpec) -> list[Rule]:
    """The runtime rules `spec` breaks."""
    return [rule for rule in RUNTIME_RULES if not rule.check(spec)]
