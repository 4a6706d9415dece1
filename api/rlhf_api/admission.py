"""The ValidatingAdmissionPolicies that refuse, at admission, a job setting a field its runtime keeps,
as far as the API server can decide it (docs/runtimes.md, "Admission").

A CRD's schema sees one object; a policy with the runtime as its parameter sees the pair. What it cannot
see is whether a job wrote a field the CRD defaults (the API server fills defaults in first), so it checks
the fields with no default, where presence means the job wrote it (`has()`): the image, every pod setting,
checkpoint.path, optional sections such as trainer.critic. It refuses only what the operator's merge
(runtime_merge.merge) refuses too: a field outside `overridable` (nor above nor below an entry of it) for
which the runtime has no value of its own; the operator checks the rest when it binds the job.
Generated from the spec schema (crd.py) into the chart; pure.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Final

import yaml

from rlhf_api.runtime_spec import (
    CLUSTER_KIND,
    CLUSTER_PLURAL,
    DEFAULT_OVERRIDABLE,
    NAMESPACED_KIND,
    NAMESPACED_PLURAL,
    NOT_IN_JOB_DEFAULTS,
)
from rlhf_api.spec import GROUP, PLURAL, VERSION

Schema = dict[str, Any]
Path = tuple[str, ...]
OUTPUT: Final = "charts/rlhf-operator/templates/runtime-admission.yaml"
_NAME: Final = '{{ include "rlhf-operator.clusterName" . }}'


def decidable_paths(schema: Schema, path: Path = ()) -> Iterator[tuple[Path, list[Path]]]:
    """Each spec field with no CRD default under objects that are always there, with the ancestors that
    must be tested with has() first (those with no default of their own)."""
    for key, child in (schema.get("properties") or {}).items():
        here = (*path, key)
        if here == ("runtimeRef",):
            continue
        if "default" not in child:
            yield here, []
        elif child.get("properties"):
            yield from decidable_paths(child, here)


def _has(root: str, path: Path) -> str:
    """has() of `root.path`, each level tested first (a missing level is an error in CEL, not false)."""
    return " && ".join(f"has({root}.{'.'.join(path[: i + 1])})" for i in range(len(path)))


def _runtime_may_have(path: Path) -> str:
    """CEL: the runtime's layer may hold a value at `path` (then only the operator can compare them)."""
    options = [] if path[0] in NOT_IN_JOB_DEFAULTS else [_has("params.spec", ("jobDefaults", *path))]
    if path == ("image",):
        options += [_has("params.spec", ("images", "cpu")), _has("params.spec", ("images", "gpu"))]
    if path[0] == "pods":
        options.append(f"({_has('params.spec', path)})")
        if path[-1] in ("volumes", "volumeMounts"):
            options += [
                _has("params.spec", ("storage", "modelCache")),
                _has("params.spec", ("storage", "checkpoints")),
            ]
    if path == ("checkpoint", "path"):
        options.append(_has("params.spec", ("storage", "checkpoints")))
    return " || ".join(f"({o})" for o in options)


def validations(schema: Schema) -> list[dict[str, Any]]:
    out = []
    for path, _ in decidable_paths(schema):
        dotted = ".".join(path)
        rule = (
            f"!variables.mine || !({_has('object.spec', path)}) || "
            f"variables.overridable.exists(p, p == '{dotted}' || '{dotted}'.startsWith(p + '.') || "
            f"p.startsWith('{dotted}.')) || {_runtime_may_have(path)}"
        )
        out.append(
            {
                "expression": rule,
                "messageExpression": f"'spec.{dotted}: ' + params.kind + '/' + params.metadata.name + "
                "' does not let jobs set this field (jobs on it may set: ' + variables.overridable.join(', ') + "
                "'); remove it from the job, or ask the platform team to add it to the runtime\\'s overridable'",
                "reason": "Forbidden",
            }
        )
    return out


def policy(kind: str, schema: Schema, prefix: str = _NAME) -> list[dict[str, Any]]:
    """The policy for jobs on runtimes of `kind`, and its binding (every runtime of that kind a param),
    named `<prefix>-<plural>` (the chart's prefix is a Helm directive)."""
    plural = CLUSTER_PLURAL if kind == CLUSTER_KIND else NAMESPACED_PLURAL
    name = f"{prefix}-{plural}"
    default = "[" + ", ".join(f"'{p}'" for p in DEFAULT_OVERRIDABLE) + "]"
    spec: dict[str, Any] = {
        "failurePolicy": "Fail",
        "paramKind": {"apiVersion": f"{GROUP}/{VERSION}", "kind": kind},
        "matchConstraints": {
            "resourceRules": [
                {
                    "apiGroups": [GROUP],
                    "apiVersions": [VERSION],
                    "operations": ["CREATE"],
                    "resources": [PLURAL],
                }
            ]
        },
        "matchConditions": [
            {
                "name": "on-this-kind-of-runtime",
                "expression": f"has(object.spec.runtimeRef) && object.spec.runtimeRef.kind == '{kind}'",
            }
        ],
        "variables": [
            {"name": "mine", "expression": "object.spec.runtimeRef.name == params.metadata.name"},
            {
                "name": "overridable",
                "expression": f"has(params.spec.overridable) ? params.spec.overridable : {default}",
            },
        ],
        "validations": validations(schema),
    }
    binding_param: dict[str, Any] = {"selector": {}, "parameterNotFoundAction": "Allow"}
    return [
        {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingAdmissionPolicy",
            "metadata": {"name": name},
            "spec": spec,
        },
        {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingAdmissionPolicyBinding",
            "metadata": {"name": name},
            "spec": {"policyName": name, "paramRef": binding_param, "validationActions": ["Deny"]},
        },
    ]


def chart_template(schema: Schema) -> str:
    """The chart's template: both policies, when the API server serves ValidatingAdmissionPolicy and
    `runtimes.admissionPolicy` is on, with the chart's labels."""
    docs = []
    for kind in (CLUSTER_KIND, NAMESPACED_KIND):
        for doc in policy(kind, schema):
            # The name is a Helm directive: inside YAML's single quotes in the spec (policyName), bare here.
            spec = yaml.safe_dump(doc["spec"], sort_keys=False, width=100000)
            docs.append(
                f"apiVersion: {doc['apiVersion']}\n"
                f"kind: {doc['kind']}\n"
                "metadata:\n"
                f"  name: {doc['metadata']['name']}\n"
                "  labels:\n"
                '    {{- include "rlhf-operator.labels" . | nindent 4 }}\n'
                "spec:\n" + "".join(f"  {line}\n" for line in spec.splitlines())
            )
    return (
        "# Generated by `rlhf crd` from api/rlhf_api/admission.py and spec.py: do not edit.\n"
        "# Jobs setting a field their runtime keeps are refused at admission (docs/runtimes.md).\n"
        "{{- if and .Values.runtimes.admissionPolicy "
        '(.Capabilities.APIVersions.Has "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy") }}\n'
        + "---\n".join(docs)
        + "{{- end }}\n"
    )
