"""Validation of RLHFJob manifests in one place: schema errors from the pydantic model and the cross-field
rules of `rules.py` (what the API server checks, same field paths and messages); a runtime manifest and a
job merged over it (`rlhf validate --runtime`, what the operator checks when it binds the job); plus
`runtime_issues`, the checks that need the files a spec names. Pure apart from reading files; never
imports kopf, the Kubernetes client, torch or Ray.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from rlhf_api.rules import violated
from rlhf_api.runtime_merge import MergeError, merge, with_crd_defaults
from rlhf_api.runtime_spec import (
    CLUSTER_KIND,
    NAMESPACED_KIND,
    AnyRuntime,
    ClusterRLHFRuntime,
    RLHFRuntime,
    RLHFRuntimeSpec,
    runtime_violations,
)
from rlhf_api.spec import API_VERSION, KIND, RLHFJobSpec

# metadata.name of a namespaced custom resource: a DNS-1123 subdomain.
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


@dataclass(frozen=True)
class Issue:
    """One problem: the field path it concerns (e.g. `spec.rollout.engines`) and what is wrong."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message


def _path(loc: tuple[int | str, ...], data: Any, error_type: str) -> str:
    """A pydantic error location as a Kubernetes field path, e.g. `spec.pods.tolerations[0].key`.

    The location is followed through the input so that union tags pydantic adds (`int`, `str`, ...)
    are dropped; a missing key, which is not in the input, is kept as the last element.
    """
    parts: list[str] = []
    for index, key in enumerate(loc):
        last = index == len(loc) - 1
        if isinstance(data, dict) and key in data:
            data = data[key]
        elif isinstance(data, list) and isinstance(key, int) and 0 <= key < len(data):
            parts.append(f"[{key}]")
            data = data[key]
            continue
        elif not (last and error_type == "missing"):
            continue
        parts.append(("." if parts else "") + str(key))
    return "".join(parts)


def _message(error: Any, kind: str) -> str:
    """The pydantic message, in the API server's words where they differ."""
    if error["type"] == "extra_forbidden":
        return f"unknown field (not in the {kind} schema)"
    if error["type"] == "missing":
        return "Required value"
    return str(error["msg"])


def schema_issues(
    model: type[BaseModel], data: Any, prefix: tuple[str, ...] = (), kind: str = KIND
) -> list[Issue]:
    """Schema errors of `data` against `model` (the spec of a `kind`), by camelCase field path (aliases
    only, strict types)."""
    try:
        model.model_validate(data, by_alias=True, by_name=False)
    except ValidationError as error:
        by_path: dict[str, list[str]] = {}
        root: Any = data
        for prefix_key in reversed(prefix):
            root = {prefix_key: root}
        for detail in error.errors():
            path = _path((*prefix, *detail["loc"]), root, detail["type"])
            messages = by_path.setdefault(path, [])
            if _message(detail, kind) not in messages:
                messages.append(_message(detail, kind))
        return [Issue(path, " or ".join(messages)) for path, messages in by_path.items()]
    return []


def validate_manifest(obj: Any) -> list[Issue]:
    """Every problem of an RLHFJob manifest, as the API server would report it on create.

    `status` is ignored, as the API server ignores it when creating through the main resource.
    """
    if not isinstance(obj, dict):
        return [Issue("", f"an RLHFJob manifest must be a mapping, not {type(obj).__name__}")]
    issues = _object_issues(obj, (KIND,))
    if "spec" not in obj:
        return [*issues, Issue("spec", "Required value")]
    return issues + job_spec_issues(obj["spec"])


def job_spec_issues(spec: Any) -> list[Issue]:
    """A job spec's schema errors, else its broken rules, else its sequence-parallel problems."""
    spec_issues = schema_issues(RLHFJobSpec, spec, ("spec",))
    if spec_issues:
        return spec_issues
    typed = RLHFJobSpec.model_validate(spec, by_alias=True, by_name=False)
    rule_issues = [Issue(rule.field_path, rule.message) for rule in violated(typed)]
    return rule_issues or sequence_parallel_issues(typed)


def _object_issues(obj: dict[str, Any], kinds: tuple[str, ...]) -> list[Issue]:
    """apiVersion, kind (one of `kinds`), metadata and unknown top-level fields."""
    issues: list[Issue] = []
    if obj.get("apiVersion") != API_VERSION:
        issues.append(Issue("apiVersion", f"must be {API_VERSION}, not {obj.get('apiVersion')!r}"))
    if obj.get("kind") not in kinds:
        issues.append(Issue("kind", f"must be {' or '.join(kinds)}, not {obj.get('kind')!r}"))
    issues += _metadata_issues(obj.get("metadata"))
    kind = str(obj["kind"]) if obj.get("kind") in kinds else kinds[0]
    for key in sorted(set(obj) - {"apiVersion", "kind", "metadata", "spec", "status"}):
        issues.append(Issue(key, f"unknown field (not in the {kind} schema)"))
    return issues


def validate_runtime_manifest(obj: Any) -> list[Issue]:
    """Every problem of a ClusterRLHFRuntime or RLHFRuntime manifest: its schema and RUNTIME_RULES, as the
    API server checks them (what it cannot check, the job on it, is `validate_on_runtime`'s)."""
    kinds = (CLUSTER_KIND, NAMESPACED_KIND)
    if not isinstance(obj, dict):
        return [Issue("", f"a runtime manifest must be a mapping, not {type(obj).__name__}")]
    issues = _object_issues(obj, kinds)
    kind = str(obj["kind"]) if obj.get("kind") in kinds else CLUSTER_KIND
    spec_issues = schema_issues(RLHFRuntimeSpec, obj.get("spec", {}), ("spec",), kind)
    if spec_issues:
        return issues + spec_issues
    spec = RLHFRuntimeSpec.model_validate(obj.get("spec", {}), by_alias=True, by_name=False)
    return issues + [Issue(f"spec.{rule.field}", rule.message) for rule in runtime_violations(spec)]


def load_runtime(path: str | Path) -> tuple[AnyRuntime | None, list[Issue]]:
    """The one runtime of a YAML file, typed, or None and the file's issues."""
    try:
        documents, parse_error = _documents(Path(path).read_text(encoding="utf-8"))
    except OSError as error:
        return None, [Issue("", f"cannot read: {error.strerror or error}")]
    if parse_error:
        return None, [parse_error]
    if len(documents) != 1:
        return None, [Issue("", f"a runtime file holds one runtime, not {len(documents)} documents")]
    (document,) = documents
    issues = validate_runtime_manifest(document)
    if issues:
        return None, issues
    model = ClusterRLHFRuntime if document["kind"] == CLUSTER_KIND else RLHFRuntime
    return model.model_validate(document, by_alias=True, by_name=False), []


def validate_on_runtime(obj: Any, runtime: AnyRuntime) -> list[Issue]:
    """An RLHFJob manifest's problems on `runtime`: its own (validate_manifest), then those of the merge
    the operator makes when it binds the job (a field the runtime keeps, a runtimeRef naming another
    runtime), then those of the merged spec, each naming the field. The job is merged as the API server
    stores it, its defaults filled in (`with_crd_defaults`), as the operator sees it."""
    issues = validate_manifest(obj)
    if issues:
        return issues
    ref = f"{runtime.kind}/{runtime.name}"
    spec = RLHFJobSpec.model_validate(obj["spec"], by_alias=True, by_name=False)
    metadata = obj["metadata"]
    namespace = str(metadata.get("namespace") or "default")
    named = f"{spec.runtime_ref.kind}/{spec.runtime_ref.name}" if spec.runtime_ref else "no runtime"
    if named != ref:
        return [
            Issue("spec.runtimeRef", f"must name {ref}, the runtime it is validated on (it names {named})")
        ]
    home = runtime.metadata.get("namespace")
    if runtime.kind == NAMESPACED_KIND and home and home != namespace:
        return [Issue("spec.runtimeRef", f"{ref} is in namespace {home}; a job in {namespace} cannot use it")]
    name = str(metadata.get("name") or metadata.get("generateName") or "")
    try:
        merged = merge(with_crd_defaults(obj["spec"]), runtime.spec, ref, name, namespace).spec
    except MergeError as error:
        return [Issue(error.path, error.message)]
    return [Issue(i.path, f"{i.message} (merged with {ref})") for i in job_spec_issues(merged)]


def runtime_issues(spec: RLHFJobSpec) -> list[Issue]:
    """What admission cannot check because it needs the files a spec names: each model a run loads is an
    HF model directory, sequence parallelism divides its head counts, and a chat template exists when
    `data.applyChatTemplate` asks for one. The trainer calls this before it starts anything; the prompt
    dataset and the reward function are loaded (and so checked) by the trainer itself."""
    paths = {
        "actor": spec.model.actor,
        "critic": spec.model.critic,  # unset under gae: the gae-needs-critic rule reports it
        "reference": spec.model.reference,  # unset: the actor's, checked as the actor
        "reward": spec.model.reward.model,
    }
    issues: list[Issue] = []
    for role in spec.model_roles():
        path = paths[role]
        if path is None:
            continue
        field = f"spec.model.{'reward.model' if role == 'reward' else role}"
        if not Path(path).is_dir():
            issues.append(Issue(field, f"model directory {path} does not exist"))
        elif not (Path(path) / "config.json").is_file():
            issues.append(Issue(field, f"{path} is not an HF model directory (no config.json)"))
    if issues:
        return issues
    issues += sequence_parallel_issues(spec)
    if spec.data.apply_chat_template and not has_chat_template(Path(spec.model.actor)):
        issues.append(
            Issue(
                "spec.data.applyChatTemplate",
                f"the actor's tokenizer ({spec.model.actor}) has no chat template",
            )
        )
    return issues


def has_chat_template(model: Path) -> bool:
    """Whether an HF tokenizer directory carries a chat template: a `chat_template.jinja` (or `.json`)
    file, a template under `additional_chat_templates/`, or `chat_template` in tokenizer_config.json."""
    if (model / "chat_template.jinja").is_file() or (model / "chat_template.json").is_file():
        return True
    extra = model / "additional_chat_templates"
    if extra.is_dir() and any(extra.glob("*.jinja")):
        return True
    try:
        config = yaml.safe_load((model / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return False
    return isinstance(config, dict) and bool(config.get("chat_template"))


def sequence_parallel_issues(spec: RLHFJobSpec) -> list[Issue]:
    """Ulysses sequence parallelism gives each rank of a group H / sequenceParallelSize attention heads,
    so every model a split group runs needs both head counts divisible by it. Admission cannot check
    this (the model is a path the API server cannot read); `rlhf validate` and the trainer read each
    model's config.json when it is there (a missing model is reported by the trainer's own checks)."""
    sp = spec.trainer.sequence_parallel_size
    if sp <= 1:
        return []
    paths = {"actor": spec.model.actor, "critic": spec.model.critic, "reference": spec.model.reference_path}
    issues: list[Issue] = []
    for roles, placement in spec.gpu_groups():
        if spec.trainer.sequence_parallel_for(placement.ranks) == 1:
            continue  # this group runs whole sequences
        for role in roles:
            path = paths.get(role)
            config = Path(path) / "config.json" if path else None
            if config is None or not config.is_file():
                continue
            try:
                data = yaml.safe_load(config.read_text(encoding="utf-8"))  # JSON is YAML
                data = data.get("text_config", data)
                heads = int(data["num_attention_heads"])
                kv_heads = int(data.get("num_key_value_heads") or heads)
            except (OSError, yaml.YAMLError, AttributeError, KeyError, TypeError, ValueError) as error:
                issues.append(
                    Issue(f"spec.model.{role}", f"cannot read the head counts in {config}: {error}")
                )
                continue
            if heads % sp or kv_heads % sp:
                issues.append(
                    Issue(
                        "spec.trainer.sequenceParallelSize",
                        f"{sp} must divide the attention heads of spec.model.{role} ({path}: "
                        f"num_attention_heads={heads}, num_key_value_heads={kv_heads})",
                    )
                )
    return issues


def _metadata_issues(metadata: Any) -> list[Issue]:
    """metadata needs a valid name (or a generateName)."""
    if not isinstance(metadata, dict):
        return [Issue("metadata", "Required value: a mapping with name")]
    if "generateName" in metadata and "name" not in metadata:
        return []
    name = metadata.get("name")
    if not isinstance(name, str) or not name:
        return [Issue("metadata.name", "Required value")]
    if len(name) > 253 or not _NAME.match(name):
        return [Issue("metadata.name", "must be a lowercase RFC 1123 subdomain (a-z, 0-9, '-', '.')")]
    return []


def _documents(text: str) -> tuple[list[Any], Issue | None]:
    """The YAML documents of `text` (empty ones dropped), or the parse error as an issue naming the line."""
    try:
        return [doc for doc in yaml.safe_load_all(text) if doc is not None], None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None) or getattr(error, "context_mark", None)
        where = f"line {mark.line + 1}" if mark is not None else ""
        problem = getattr(error, "problem", None) or str(error)
        return [], Issue(where, f"malformed YAML: {problem}")


def validate_text(text: str, runtime: AnyRuntime | None = None) -> list[Issue]:
    """Issues of every RLHFJob document in a YAML text (each merged over `runtime` when given); a
    document's issues are prefixed `[doc N]` when there is more than one."""
    documents, parse_error = _documents(text)
    if parse_error:
        return [parse_error]
    if not documents:
        return [Issue("", "no YAML document found")]
    issues: list[Issue] = []
    for number, document in enumerate(documents, start=1):
        found = validate_manifest(document) if runtime is None else validate_on_runtime(document, runtime)
        if len(documents) > 1:
            found = [Issue(f"[doc {number}] {issue.path}".rstrip(), issue.message) for issue in found]
        issues += found
    return issues


def validate_file(path: str | Path, runtime: AnyRuntime | None = None) -> list[Issue]:
    """Issues of the RLHFJob manifests in a YAML file (`-` reads standard input), on `runtime` if given."""
    if str(path) == "-":
        return validate_text(sys.stdin.read(), runtime)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as error:
        return [Issue("", f"cannot read: {error.strerror or error}")]
    return validate_text(text, runtime)


def format_issues(source: str, issues: Iterable[Issue]) -> list[str]:
    """One `SOURCE: path: message` line per issue, as `rlhf validate` prints them."""
    return [f"{source}: {issue}" for issue in issues]
