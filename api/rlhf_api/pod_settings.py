"""A role's effective pod settings: the job-wide defaults under `spec.pods`, refined by `pods.fabric` for
the pods that talk NCCL (trainer and rollout), then by `pods.<role>`, over the defaults that make every
pod pass the restricted Pod Security Standard. Pure.

Merge rules (documented in docs/api.md): maps merge key by key; name-keyed lists merge by that key
(the role's entry replaces the default's, in the default's place); tolerations and envFrom add up;
security contexts merge field by field; affinity and plain strings replace.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final, Literal

from rlhf_api.spec import DEFAULT_GPU_RESOURCE, PodSettings, PodsSpec

PodRole = Literal["head", "trainer", "rollout"]
POD_ROLES: Final[tuple[PodRole, ...]] = ("head", "trainer", "rollout")
# The roles whose pods join NCCL groups (ZeRO-3 among trainer ranks, the weight sync with the engines).
FABRIC_ROLES: Final[tuple[PodRole, ...]] = ("trainer", "rollout")
# The trainer image's user (trainer_image/Dockerfile). The restricted profile needs a non-root uid, no
# privilege escalation, every capability dropped and a seccomp profile; fsGroup makes a PVC writable.
IMAGE_UID: Final = 10001
DEFAULT_POD_SECURITY_CONTEXT: Final[dict[str, Any]] = {
    "runAsNonRoot": True,
    "runAsUser": IMAGE_UID,
    "runAsGroup": IMAGE_UID,
    "fsGroup": IMAGE_UID,
    "seccompProfile": {"type": "RuntimeDefault"},
}
DEFAULT_CONTAINER_SECURITY_CONTEXT: Final[dict[str, Any]] = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
}


def _by_key(key: str) -> Callable[[list[Any] | None, list[Any] | None], list[Any] | None]:
    def merge(base: list[Any] | None, over: list[Any] | None) -> list[Any] | None:
        if not over:
            return list(base) if base else None
        mine = {_get(item, key): item for item in over}
        out = [mine.pop(_get(item, key), item) for item in base or []]
        return out + [item for item in over if _get(item, key) in mine]

    return merge


def _get(item: Any, key: str) -> Any:
    return item.get(key) if isinstance(item, dict) else getattr(item, key, None)


def _maps(base: dict[str, Any] | None, over: dict[str, Any] | None) -> dict[str, Any] | None:
    merged = {**(base or {}), **(over or {})}
    return merged or None


def _add(base: list[Any] | None, over: list[Any] | None) -> list[Any] | None:
    merged = [*(base or []), *(over or [])]
    return merged or None


def _replace(base: Any, over: Any) -> Any:
    return base if over is None else over


_MERGE: Final[dict[str, Callable[[Any, Any], Any]]] = {
    "node_selector": _maps,
    "labels": _maps,
    "annotations": _maps,
    "security_context": _maps,
    "container_security_context": _maps,
    "tolerations": _add,
    "env_from": _add,
    "env": _by_key("name"),
    "volumes": _by_key("name"),
    "volume_mounts": _by_key("mountPath"),
    "image_pull_secrets": _by_key("name"),
}


def merged(defaults: PodSettings, role: PodSettings | None) -> PodSettings:
    """`role` over `defaults`, field by field, by the rules in the module docstring."""
    role = role or PodSettings()
    values: dict[str, Any] = {}
    for name in PodSettings.model_fields:
        base, over = getattr(defaults, name), getattr(role, name)
        if name in ("resources", "resources_per_gpu"):
            values[name] = _resources(base, over)
        else:
            values[name] = _MERGE.get(name, _replace)(base, over)
    return PodSettings.model_construct(**values)


def _resources(base: Any, over: Any) -> Any:
    if base is None or over is None:
        return over if base is None else base
    return type(base).model_construct(
        requests=_maps(base.requests, over.requests), limits=_maps(base.limits, over.limits)
    )


def for_role(pods: PodsSpec, role: PodRole) -> PodSettings:
    """The settings of `role`'s pods: the job-wide defaults, then `pods.fabric` (FABRIC_ROLES only), then
    `pods.<role>`; before the restricted-profile defaults (see `security_contexts`)."""
    defaults = merged(pods, pods.fabric) if role in FABRIC_ROLES else pods
    return merged(defaults, getattr(pods, role))


def gpu_resource(settings: PodSettings) -> str:
    return settings.gpu_resource_name or DEFAULT_GPU_RESOURCE


def security_contexts(settings: PodSettings) -> tuple[dict[str, Any], dict[str, Any]]:
    """(pod, container) security contexts: the user's fields over the restricted-profile defaults."""
    pod = {**DEFAULT_POD_SECURITY_CONTEXT, **(settings.security_context or {})}
    container = {**DEFAULT_CONTAINER_SECURITY_CONTEXT, **(settings.container_security_context or {})}
    return pod, container
