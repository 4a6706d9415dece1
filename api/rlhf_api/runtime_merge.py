"""A job on a runtime: the runtime's layer (its job defaults, image, Ray version, pods and storage) under
the fields the job set, where the runtime lets the job set them. Pure: the operator and `rlhf validate
--runtime` call the same function, so the merged spec is the same on both sides.

"Set" means different from the CRD's default: the API server fills every default in before anyone sees
the job, so a field equal to its default cannot be told from one left out, and counts as left out (the
runtime's value holds there). The rules, field by field, are in docs/runtimes.md:
- a set field outside the runtime's `overridable` paths (and ALWAYS_THE_JOBS) is an error naming it,
  unless it equals the runtime's own value; an object the CRD gives no default (trainer.critic) is set
  by being there;
- maps merge key by key and the job's scalars and lists replace the runtime's, except under `pods`, which
  merges by spec.pods' own rules (pod_settings.py);
- the image is the job's, else the runtime's GPU image for a job whose pods get GPUs, else its CPU image
  (the runtime's images, like its Ray version and pods, win over its own `jobDefaults`);
- the runtime's storage becomes volumes mounted in every pod (a job's volume or mount of the same name
  or path is an error), and `checkpoint.path` defaults to `<mountPath>/<namespace>/<job>` on its
  checkpoint volume.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any, Final

from rlhf_api import pod_settings, pod_shape
from rlhf_api.model_source import parse_source
from rlhf_api.runtime_spec import (
    CHECKPOINTS_VOLUME,
    RLHFRuntimeSpec,
    RuntimeVolume,
)
from rlhf_api.spec import PodSettings, PodsSpec, RLHFJobSpec

Schema = dict[str, Any]
Path = tuple[str, ...]
# The fields no runtime keeps: the job's runtimeRef, and rollout.engines, the scale subresource's replica
# count, which `kubectl scale`, an HPA and the operator's autoscaler write after the job starts.
ALWAYS_THE_JOBS: Final = ("runtimeRef", "rollout.engines")


class MergeError(ValueError):
    """A job field its runtime does not let it set (or a runtime layer that does not merge)."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path
        self.message = message


@dataclass(frozen=True)
class Merged:
    """The merged spec (camelCase, before pydantic's defaults) and the per-job claim it needs, if any."""

    spec: dict[str, Any]
    checkpoint_claim: str | None


@cache
def _spec_schema() -> Schema:
    from rlhf_api.crd import spec_schema  # the CRD's defaults are what the API server filled in

    return spec_schema()


def with_crd_defaults(spec: dict[str, Any], schema: Schema | None = None) -> dict[str, Any]:
    """`spec` as the API server stores it, for `rlhf validate --runtime` and the tests to merge what the
    operator will see: a null is dropped (no field is nullable), then every missing field with a default in
    the CRD's schema gets it, recursively, into the defaults it fills in too."""
    out = _defaulted(spec, schema if schema is not None else _spec_schema())
    assert isinstance(out, dict)
    return out


def _defaulted(value: Any, node: Schema) -> Any:
    if isinstance(value, list) and isinstance(node.get("items"), dict):
        return [_defaulted(item, node["items"]) for item in value]
    if not isinstance(value, dict):
        return value
    props: Schema = node.get("properties") or {}
    extra = node.get("additionalProperties")
    out = {}
    for key, child in value.items():
        if child is None and key in props:
            continue
        sub = props.get(key, extra if isinstance(extra, dict) else None)
        out[key] = _defaulted(child, sub) if sub is not None else child
    for key, sub in props.items():
        if key not in out and "default" in sub:
            out[key] = _defaulted(copy.deepcopy(sub["default"]), sub)
    return out


def set_fields(spec: dict[str, Any], schema: Schema | None = None) -> list[tuple[Path, Any]]:
    """The leaves of `spec` that differ from the CRD's defaults, as (camelCase path, value).

    A leaf is a scalar, a list, or a map without a fixed schema (nodeSelector, jobDefaults' open objects).
    An object the CRD gives no default (trainer.critic, pods.trainer) is there only because the job wrote
    it, so it is set even when each of its fields equals its default: it is a leaf then, as written.
    """
    return list(_walk(spec, schema if schema is not None else _spec_schema(), ()))


def _walk(value: Any, node: Schema, path: Path) -> Iterator[tuple[Path, Any]]:
    props = node.get("properties")
    if not (props and isinstance(value, dict)):
        if path:
            yield path, value
        return
    found = False
    for key, child in value.items():
        sub = props.get(key)
        if sub is None:
            found = True
            yield (*path, key), child  # not in the schema: the API server prunes these; kept as a leaf
        elif "default" in sub and child == sub["default"]:
            continue
        else:
            for leaf in _walk(child, sub, (*path, key)):
                found = True
                yield leaf
    if path and not found and "default" not in node:
        yield path, value


def _tree(leaves: Sequence[tuple[Path, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for path, value in leaves:
        node = out
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    return out


def _get(tree: Any, path: Path) -> Any:
    for part in path:
        if not isinstance(tree, dict) or part not in tree:
            return None
        tree = tree[part]
    return tree


def allowed(path: Path, overridable: Sequence[str]) -> bool:
    """Whether the job may set the field at `path`: it, or a field above it, is in `overridable` (or in
    ALWAYS_THE_JOBS)."""
    dotted = ".".join(path)
    return any(dotted == p or dotted.startswith(p + ".") for p in (*ALWAYS_THE_JOBS, *overridable))


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over` on `base`: maps merge key by key, anything else in `over` replaces."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def merge_pods(base: dict[str, Any] | None, over: dict[str, Any] | None) -> dict[str, Any] | None:
    """`over`'s spec.pods on `base`'s, section by section, by spec.pods' merge rules."""
    if not over or not base:
        return over or base or None
    b, o = PodsSpec.model_validate(base), PodsSpec.model_validate(over)
    out = pod_settings.merged(b, o).model_dump(by_alias=True, exclude_none=True)
    for section in ("fabric", "head", "trainer", "rollout"):
        bs, os_ = getattr(b, section), getattr(o, section)
        if bs is not None or os_ is not None:
            merged = pod_settings.merged(bs or PodSettings(), os_)
            out[section] = merged.model_dump(by_alias=True, exclude_none=True)
    return out


def claim_name(job: str, volume: str = CHECKPOINTS_VOLUME) -> str:
    """The per-job claim made from a runtime's template."""
    return f"{job}-{volume}"


def _volume(name: str, volume: RuntimeVolume, job: str) -> tuple[dict[str, Any], dict[str, Any]]:
    claim = volume.claim_name or claim_name(job, name)
    source: dict[str, Any] = {"claimName": claim}
    mount: dict[str, Any] = {"name": name, "mountPath": volume.mount_path}
    if volume.read_only:
        source["readOnly"] = True
        mount["readOnly"] = True
    return {"name": name, "persistentVolumeClaim": source}, mount


def runtime_layer(runtime: RLHFRuntimeSpec, job: str, namespace: str) -> dict[str, Any]:
    """What the runtime gives a job before the job's own fields: its job defaults, then its Ray version,
    pods and storage (the platform's fields win over its own job defaults). No image yet (`merge`)."""
    layer = dict(runtime.job_defaults or {})
    if runtime.ray_version:
        layer["rayVersion"] = runtime.ray_version
    pods = runtime.pods.model_dump(by_alias=True, exclude_none=True) if runtime.pods else None
    storage = runtime.storage
    volumes, mounts = [], []
    for name, volume in storage.volumes() if storage else []:
        v, m = _volume(name, volume, job)
        volumes.append(v)
        mounts.append(m)
    if volumes:
        pods = merge_pods(pods, {"volumes": volumes, "volumeMounts": mounts})
    if pods:
        layer["pods"] = pods
    if storage and storage.checkpoints:
        path = f"{storage.checkpoints.mount_path.rstrip('/')}/{namespace}/{job}"
        layer["checkpoint"] = deep_merge(layer.get("checkpoint") or {}, {"path": path})
    if (
        storage
        and storage.model_cache
        and storage.model_cache.claim_name
        and not storage.model_cache.read_only
    ):
        # A writable cache is where the fetch step puts the job's hf:// and s3:// models.
        cache = {"claimName": storage.model_cache.claim_name, "mountPath": storage.model_cache.mount_path}
        layer["storage"] = deep_merge(layer.get("storage") or {}, {"modelCache": cache})
    return layer


def merge(
    job_spec: dict[str, Any],
    runtime: RLHFRuntimeSpec,
    ref: str,
    job: str,
    namespace: str,
    gpu_standin: bool = False,
) -> Merged:
    """The job's spec merged over `runtime` (named `ref`, e.g. `ClusterRLHFRuntime/h100-ib`). With
    `gpu_standin` (the operator's named CPU stand-in for advertised GPUs) the runtime's CPU image is used.

    Raises MergeError naming the first field the job sets that the runtime keeps. The result still has to
    pass the job's own validation (schema and rules), which the callers run.
    """
    layer = runtime_layer(runtime, job, namespace)
    leaves = set_fields(job_spec)
    # The platform's image over its own job defaults, picked for the job as it will run (not its image).
    image = _image(
        _over(layer, {k: v for k, v in _tree(leaves).items() if k != "image"}), runtime, gpu_standin
    )
    if image:
        layer["image"] = image
    overridable = runtime.allowed()
    for path, value in leaves:
        if not allowed(path, overridable) and _get(layer, path) != value:
            dotted = ".".join(path)
            raise MergeError(
                f"spec.{dotted}",
                f"{ref} does not let jobs set this field (jobs on it may set: {', '.join(overridable)}); "
                "remove it from the job, or ask the platform team to add it to the runtime's overridable",
            )
    # A value the runtime already has adds nothing (and would add a toleration twice).
    mine = _tree([(path, value) for path, value in leaves if _get(layer, path) != value])
    _check_storage_names(mine.get("pods"), runtime, ref)
    template = runtime.storage.claim_template() if runtime.storage else None
    merged = _over(layer, mine)
    _check_remote_models(merged, ref)
    _check_export(merged, ref)
    return Merged(merged, claim_name(job) if template is not None else None)


def _check_export(merged: dict[str, Any], ref: str) -> None:
    """Admission let checkpoint.exportTo through on the promise of the runtime's checkpoint volume."""
    checkpoint = merged.get("checkpoint") or {}
    if checkpoint.get("exportTo") and not checkpoint.get("path"):
        raise MergeError(
            "spec.checkpoint.exportTo",
            f"{ref} has no checkpoint volume, so the job has no checkpoint.path to export from: set "
            "checkpoint.path, or ask the platform team for storage.checkpoints on the runtime",
        )


def _check_remote_models(merged: dict[str, Any], ref: str) -> None:
    """Admission let hf:// and s3:// models through on the promise of the runtime's model cache."""
    if (merged.get("storage") or {}).get("modelCache"):
        return
    model = merged.get("model") or {}
    fields = {f"spec.model.{k}": model.get(k) for k in ("actor", "critic", "reference")}
    fields["spec.model.reward.model"] = (model.get("reward") or {}).get("model")
    for field, uri in fields.items():
        if isinstance(uri, str) and parse_source(uri).remote:
            raise MergeError(
                field,
                f"{uri} is fetched into a model cache before the trainer starts, and {ref} has no writable "
                "storage.modelCache: name a path on the runtime's volumes, or ask the platform team for a "
                "writable model cache",
            )


def _over(layer: dict[str, Any], mine: dict[str, Any]) -> dict[str, Any]:
    """`mine` over `layer`: pods by spec.pods' rules, everything else by `deep_merge`."""
    merged = deep_merge(
        {k: v for k, v in layer.items() if k != "pods"}, {k: v for k, v in mine.items() if k != "pods"}
    )
    pods = merge_pods(layer.get("pods"), mine.get("pods"))
    if pods:
        merged["pods"] = pods
    return merged


def _check_storage_names(pods: dict[str, Any] | None, runtime: RLHFRuntimeSpec, ref: str) -> None:
    """A job's own volume or mount would replace the runtime's storage in the merge (volumes merge by name,
    mounts by path): refused, naming it, rather than losing the model cache or the checkpoints silently."""
    volumes = runtime.storage.volumes() if runtime.storage else []
    taken = {
        "volumes": ("name", {n for n, _ in volumes}),
        "volumeMounts": ("mountPath", {v.mount_path for _, v in volumes}),
    }
    for section in ("", "fabric", "head", "trainer", "rollout"):
        settings = (pods or {}).get(section) or {} if section else pods or {}
        for field, (key, values) in taken.items():
            for index, item in enumerate(settings.get(field) or []):
                if isinstance(item, dict) and item.get(key) in values:
                    where = ".".join(["spec.pods", *([section] if section else []), f"{field}[{index}]"])
                    raise MergeError(
                        f"{where}.{key}",
                        f"{item[key]} is {ref}'s storage (spec.storage), mounted in every pod: use another",
                    )


def _image(merged: dict[str, Any], runtime: RLHFRuntimeSpec, gpu_standin: bool) -> str | None:
    images = runtime.images
    if images is None:
        return None
    if gpu_standin:  # the cluster's GPUs are advertised, not real (RLHF_GPU_STANDIN): the CPU image runs
        return images.cpu or images.gpu
    if images.gpu and images.cpu:
        try:
            spec = RLHFJobSpec.model_validate(merged)
        except ValueError:
            return images.cpu  # the caller's validation reports what is wrong
        return images.gpu if asks_gpus(spec) else images.cpu
    return images.gpu or images.cpu


def asks_gpus(spec: RLHFJobSpec) -> bool:
    """Whether any of the job's pods requests a GPU (the GPU image's case)."""
    return pod_shape.trainer_pods(spec)[1] > 0 or pod_shape.rollout_pods(spec)[1] > 0
