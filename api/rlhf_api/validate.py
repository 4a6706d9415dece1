"""Validation of RLHFJob manifests in one place: schema errors from the pydantic model and the cross-field
rules of `rules.py` (what the API server checks, same field paths and messages), plus `runtime_issues`,
the checks that need the files a spec names. Pure apart from reading files; never imports kopf, the
Kubernetes client, torch or Ray.
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


def _message(error: Any) -> str:
    """The pydantic message, in the API server's words where they differ."""
    if error["type"] == "extra_forbidden":
        return "unknown field (not in the RLHFJob schema)"
    if error["type"] == "missing":
        return "Required value"
    return str(error["msg"])


def schema_issues(model: type[BaseModel], data: Any, prefix: tuple[str, ...] = ()) -> list[Issue]:
    """Schema errors of `data` against `model`, by camelCase field path (aliases only, strict types)."""
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
            if _message(detail) not in messages:
                messages.append(_message(detail))
        return [Issue(path, " or ".join(messages)) for path, messages in by_path.items()]
    return []


def validate_manifest(obj: Any) -> list[Issue]:
    """Every problem of an RLHFJob manifest, as the API server would report it on create.

    `status` is ignored, as the API server ignores it when creating through the main resource.
    """
    if not isinstance(obj, dict):
        return [Issue("", f"an RLHFJob manifest must be a mapping, not {type(obj).__name__}")]
    issues: list[Issue] = []
    if obj.get("apiVersion") != API_VERSION:
        issues.append(Issue("apiVersion", f"must be {API_VERSION}, not {obj.get('apiVersion')!r}"))
    if obj.get("kind") != KIND:
        issues.append(Issue("kind", f"must be {KIND}, not {obj.get('kind')!r}"))
    issues += _metadata_issues(obj.get("metadata"))
    for key in sorted(set(obj) - {"apiVersion", "kind", "metadata", "spec", "status"}):
        issues.append(Issue(key, "unknown field (not in the RLHFJob schema)"))
    if "spec" not in obj:
        return [*issues, Issue("spec", "Required value")]
    spec_issues = schema_issues(RLHFJobSpec, obj["spec"], ("spec",))
    if spec_issues:
        return issues + spec_issues
    spec = RLHFJobSpec.model_validate(obj["spec"], by_alias=True, by_name=False)
    rule_issues = [Issue(rule.field_path, rule.message) for rule in violated(spec)]
    return issues + (rule_issues or sequence_parallel_issues(spec))


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


def validate_text(text: str) -> list[Issue]:
    """Issues of every RLHFJob document in a YAML text; a document's issues are prefixed
    `[doc N]` when there is more than one."""
    documents, parse_error = _documents(text)
    if parse_error:
        return [parse_error]
    if not documents:
        return [Issue("", "no YAML document found")]
    issues: list[Issue] = []
    for number, document in enumerate(documents, start=1):
        found = validate_manifest(document)
        if len(documents) > 1:
            found = [Issue(f"[doc {number}] {issue.path}".rstrip(), issue.message) for issue in found]
        issues += found
    return issues


def validate_file(path: str | Path) -> list[Issue]:
    """Issues of the RLHFJob manifests in a YAML file (`-` reads standard input)."""
    if str(path) == "-":
        return validate_text(sys.stdin.read())
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as error:
        return [Issue("", f"cannot read: {error.strerror or error}")]
    return validate_text(text)


def format_issues(source: str, issues: Iterable[Issue]) -> list[str]:
    """One `SOURCE: path: message` line per issue, as `rlhf validate` prints them."""
    return [f"{source}: {issue}" for issue in issues]
