"""The generated CRD: committed copies never drift from the model, the schema is structural and
explainable, defaults and rules agree with the pydantic model, and every path it names exists."""

from __future__ import annotations

import io
import json
import re
from collections.abc import Iterator
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic.alias_generators import to_camel
from rlhf_api import admission, crd, k8s_schemas
from rlhf_api.rules import RULES, UPDATE_RULES
from rlhf_api.spec import JOB_PHASES, K8S_TYPE_KEY, PodSettings, RLHFJobSpec
from rlhf_cli.main import main as cli_main

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "crds" / "rlhfjobs.rlhf.dev.yaml"
CHART_COPY = ROOT / "charts" / "rlhf-operator" / "crds" / "rlhfjobs.rlhf.dev.yaml"


@pytest.fixture(scope="module")
def definition() -> dict[str, Any]:
    return crd.build_crd()


@pytest.fixture(scope="module")
def root_schema(definition: dict[str, Any]) -> dict[str, Any]:
    schema: dict[str, Any] = definition["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schema


def walk(node: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """Every schema node with its path (`.items` and `.*` for array items and map values)."""
    yield path, node
    for name, child in node.get("properties", {}).items():
        yield from walk(child, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        yield from walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from walk(node["additionalProperties"], f"{path}.*")


def node_at(schema: dict[str, Any], dotted: str) -> dict[str, Any]:
    node = schema
    for part in filter(None, dotted.strip(".").split(".")):
        assert part in node.get("properties", {}), f"{dotted}: no property {part!r}"
        node = node["properties"][part]
    return node


# ---- drift -------------------------------------------------------------------------------------


def test_committed_crd_is_the_generated_one() -> None:
    assert COMMITTED.read_text(encoding="utf-8") == crd.crd_yaml(), "run `make crd` and commit the result"


def test_chart_copy_is_the_generated_one() -> None:
    assert CHART_COPY.read_text(encoding="utf-8") == crd.crd_yaml(), "run `make crd` and commit the result"


def test_rlhf_crd_prints_exactly_the_generated_yaml() -> None:
    out = io.StringIO()
    with redirect_stdout(out):
        assert cli_main(["crd"]) == 0
    assert out.getvalue() == crd.crd_yaml()
    assert yaml.safe_load(out.getvalue()) == crd.build_crd()


def test_write_puts_both_copies_under_root(tmp_path: Path) -> None:
    assert crd.main(["--write", "--root", str(tmp_path)]) == 0
    for relative in ("crds/rlhfjobs.rlhf.dev.yaml", "charts/rlhf-operator/crds/rlhfjobs.rlhf.dev.yaml"):
        assert (tmp_path / relative).read_text(encoding="utf-8") == crd.crd_yaml()
    for name, text in crd.all_crds().items():
        assert (tmp_path / "crds" / name).read_text(encoding="utf-8") == text
        assert (tmp_path / "charts/rlhf-operator/crds" / name).read_text(encoding="utf-8") == text
    assert (tmp_path / admission.OUTPUT).read_text(encoding="utf-8") == admission.chart_template(
        crd.spec_schema()
    )


def test_the_committed_runtime_crds_and_admission_policy_are_the_generated_ones() -> None:
    root = Path(__file__).resolve().parents[2]
    for name, text in crd.all_crds().items():
        assert (root / "crds" / name).read_text(encoding="utf-8") == text, f"run `make crd`: {name}"
    committed = (root / admission.OUTPUT).read_text(encoding="utf-8")
    assert committed == admission.chart_template(crd.spec_schema()), "run `make crd`: the admission policy"


def test_admission_checks_only_fields_whose_presence_means_the_job_set_them() -> None:
    """A field with a CRD default is always present after defaulting: checking it would refuse every job."""
    schema = crd.spec_schema()
    paths = {".".join(p) for p, _ in admission.decidable_paths(schema)}
    assert {"image", "pods.nodeSelector", "pods.rollout", "checkpoint.path", "trainer.critic"} <= paths, paths
    assert not {"rayVersion", "algorithm.klCoef", "rollout.engines", "security.networkPolicy"} & paths, paths
    assert "runtimeRef" not in paths and not any(p.startswith("runtimeRef.") for p in paths)


# ---- identity and subresources -----------------------------------------------------------------


def test_names_group_and_scope(definition: dict[str, Any]) -> None:
    assert definition["apiVersion"] == "apiextensions.k8s.io/v1"
    assert definition["metadata"]["name"] == "rlhfjobs.rlhf.dev"
    spec = definition["spec"]
    assert spec["group"] == "rlhf.dev"
    assert spec["scope"] == "Namespaced"
    assert spec["names"] == {
        "kind": "RLHFJob",
        "listKind": "RLHFJobList",
        "plural": "rlhfjobs",
        "singular": "rlhfjob",
        "shortNames": ["rlhf"],
        "categories": ["rlhf"],
    }
    [version] = spec["versions"]
    assert (version["name"], version["served"], version["storage"]) == ("v1alpha1", True, True)


def test_status_and_scale_subresources_point_at_real_fields(
    definition: dict[str, Any], root_schema: dict[str, Any]
) -> None:
    sub = definition["spec"]["versions"][0]["subresources"]
    assert sub["status"] == {}
    scale = sub["scale"]
    assert scale["specReplicasPath"] == ".spec.rollout.engines"
    assert scale["statusReplicasPath"] == ".status.rollout.readyEngines"
    assert node_at(root_schema, scale["specReplicasPath"])["type"] == "integer"
    assert node_at(root_schema, scale["statusReplicasPath"])["type"] == "integer"
    assert node_at(root_schema, scale["labelSelectorPath"])["type"] == "string"


def test_printer_columns(definition: dict[str, Any], root_schema: dict[str, Any]) -> None:
    columns = definition["spec"]["versions"][0]["additionalPrinterColumns"]
    default_view = [c["name"] for c in columns if not c.get("priority")]
    assert default_view == ["Phase", "Step", "GenShare", "Engines", "Age"]
    by_name = {c["name"]: c for c in columns}
    assert by_name["Step"]["jsonPath"] == ".status.progress"
    assert by_name["GenShare"]["jsonPath"] == ".status.generationShare"
    assert by_name["Engines"]["jsonPath"] == ".status.rollout.readyEngines"
    assert by_name["Age"]["type"] == "date"
    for column in columns:
        if not column["jsonPath"].startswith(".metadata"):
            leaf = node_at(root_schema, column["jsonPath"])
            assert leaf["type"] == column["type"] or (column["type"], leaf["type"]) == ("number", "integer")


def test_status_schema(root_schema: dict[str, Any]) -> None:
    status = root_schema["properties"]["status"]
    assert status["properties"]["phase"]["enum"] == list(JOB_PHASES)
    conditions = status["properties"]["conditions"]
    assert conditions["x-kubernetes-list-type"] == "map"
    assert conditions["x-kubernetes-list-map-keys"] == ["type"]
    assert set(conditions["items"]["required"]) == {
        "type",
        "status",
        "lastTransitionTime",
        "reason",
        "message",
    }
    assert status["properties"]["phaseSeconds"]["additionalProperties"] == {"type": "number"}
    assert status["properties"]["lastStepTime"]["format"] == "date-time"
    for name in (
        "rayClusterName",
        "submissionId",
        "lastScaleTime",
        "observedGeneration",
        "restarts",
        "progress",
    ):
        assert name in status["properties"], name


# ---- structural schema -------------------------------------------------------------------------


def test_schema_is_structural(root_schema: dict[str, Any]) -> None:
    forbidden = {"$ref", "$defs", "anyOf", "oneOf", "allOf", "not", "title", "const", "nullable"}
    for path, node in walk(root_schema):
        assert not forbidden & set(node), f"{path}: {sorted(forbidden & set(node))}"
        has_type = "type" in node
        assert has_type or node.get("x-kubernetes-int-or-string"), f"{path}: no type"
        if "properties" in node:
            assert "additionalProperties" not in node, path
        if node.get("type") == "object":
            assert (
                "properties" in node
                or "additionalProperties" in node
                or node.get("x-kubernetes-preserve-unknown-fields")
                or path == ".metadata"
            ), f"{path}: an object must say what it holds"
        for bound in ("exclusiveMinimum", "exclusiveMaximum"):
            if bound in node:
                assert node[bound] is True, f"{path}: {bound} must be a boolean in OpenAPI v3"
                assert ("minimum" if bound == "exclusiveMinimum" else "maximum") in node, path


K8S_TYPED = {
    to_camel(name): str((field.json_schema_extra or {})[K8S_TYPE_KEY])  # type: ignore[index]
    for name, field in PodSettings.model_fields.items()
    if isinstance(field.json_schema_extra, dict) and K8S_TYPE_KEY in field.json_schema_extra
}
POD_SETTINGS_PATHS = (
    "spec.pods",
    "spec.pods.fabric",
    "spec.pods.head",
    "spec.pods.trainer",
    "spec.pods.rollout",
)


def _inside_kubernetes_type(path: str) -> bool:
    """Below a core/v1-typed field's own properties: descriptions are dropped there to keep the CRD small."""
    parts = path.replace("[]", "").split(".")
    for i, part in enumerate(parts):
        if part in K8S_TYPED and i >= 3 and parts[i - 1] in ("pods", "fabric", "head", "trainer", "rollout"):
            return len(parts) - i >= 2
    return False


def test_every_property_has_a_type_and_a_description(root_schema: dict[str, Any]) -> None:
    properties = 0
    for path, node in walk(root_schema):
        for name, child in node.get("properties", {}).items():
            properties += 1
            if f"{path}.{name}" == ".metadata":  # the API server allows nothing but `type` there
                assert child == {"type": "object"}
                continue
            if _inside_kubernetes_type(f"{path}.{name}"):
                assert "type" in child or child.get("x-kubernetes-int-or-string"), f"{path}.{name}: no type"
                continue
            assert child.get("description", "").strip(), f"{path}.{name}: no description"
            assert "type" in child or child.get("x-kubernetes-int-or-string"), f"{path}.{name}: no type"
    assert properties > 100


def test_kubernetes_objects_are_typed_with_kubernetes_schemas(root_schema: dict[str, Any]) -> None:
    """In every role, each core/v1 field carries Kubernetes' own schema of its type (for the object, or
    each item of the list): `kubectl explain` documents it and admission checks it."""
    assert set(K8S_TYPED.values()) == set(k8s_schemas.TYPES)
    for where in POD_SETTINGS_PATHS:
        pods = node_at(root_schema, where)
        for name, kind in K8S_TYPED.items():
            node = pods["properties"][name]
            typed = node.get("items", node)
            assert typed["properties"].keys() == k8s_schemas.schema(kind)["properties"].keys(), (where, name)
            assert node["description"], (where, name)
    tolerations = node_at(root_schema, "spec.pods.trainer.tolerations")["items"]["properties"]
    assert tolerations["tolerationSeconds"]["type"] == "integer"
    volume = node_at(root_schema, "spec.pods.volumes")["items"]
    assert volume["required"] == ["name"] and "persistentVolumeClaim" in volume["properties"]
    quantity = node_at(root_schema, "spec.pods.resources.requests")["additionalProperties"]
    assert quantity["x-kubernetes-int-or-string"] is True
    assert re.match(quantity["pattern"], "64Gi") and not re.match(quantity["pattern"], "64GB")


def test_stored_kubernetes_schemas_are_what_the_generator_makes() -> None:
    """k8s_core_v1.json is generated, never edited: regenerate from the OpenAPI document when present."""
    document = k8s_schemas.openapi_document()
    if not document.exists():
        pytest.fail(
            f"{document} is missing: `make cluster-build` puts k8s.io/kubernetes in the Go module cache"
        )
    assert k8s_schemas.extract(json.loads(document.read_text())) == k8s_schemas.stored()


def test_bounds_and_enums_come_from_the_model(root_schema: dict[str, Any]) -> None:
    assert node_at(root_schema, "spec.rollout.engines")["minimum"] == 1
    gpu_memory = node_at(root_schema, "spec.rollout.gpuMemoryUtilization")
    assert (gpu_memory["minimum"], gpu_memory["exclusiveMinimum"], gpu_memory["maximum"]) == (0, True, 1)
    assert node_at(root_schema, "spec.trainer.zeroStage")["maximum"] == 3
    assert node_at(root_schema, "spec.algorithm.advantageEstimator")["enum"] == [
        "gae",
        "grpo",
        "rloo",
        "reinforce_pp",
        "reinforce_pp_baseline",
    ]
    assert node_at(root_schema, "spec.weightSync.backend")["enum"] == [
        "auto",
        "nccl",
        "gloo",
        "cuda_ipc",
        "shm",
    ]
    assert node_at(root_schema, "spec.algorithm.lambda")["type"] == "number"
    assert node_at(root_schema, "spec.weightSync.bucketSizeMiB")["type"] == "integer"
    assert node_at(root_schema, "spec")["required"] == ["model", "data"]
    assert "critic" not in node_at(root_schema, "spec.model")["required"]


def apply_defaults(node: dict[str, Any], value: Any) -> Any:
    """Structural defaulting as the API server does it: absent properties with a default get it, and
    defaulted or present objects are defaulted recursively."""
    if not isinstance(value, dict) or "properties" not in node:
        return value
    out = dict(value)
    for name, child in node["properties"].items():
        if name not in out and "default" in child:
            out[name] = child["default"]
        if name in out:
            out[name] = apply_defaults(child, out[name])
    return out


@pytest.mark.parametrize(
    "manifest",
    [
        {
            "model": {"actor": "/a", "reward": {"type": "function", "function": "r:f"}},
            "data": {"prompts": "/p"},
        },
        {
            "model": {"actor": "/a", "critic": "/c", "reward": {"type": "model", "model": "/rm"}},
            "data": {"prompts": "/p"},
            "trainer": {"critic": {"nodes": 2}},
            "rollout": {"autoscaling": {"enabled": True}},
            "pods": {"nodeSelector": {"a": "b"}},
        },
    ],
)
def test_crd_defaults_equal_the_model_defaults(root_schema: dict[str, Any], manifest: dict[str, Any]) -> None:
    by_server = apply_defaults(node_at(root_schema, "spec"), manifest)
    by_model = RLHFJobSpec.model_validate(manifest).model_dump(by_alias=True, exclude_none=True, mode="json")
    assert by_server == by_model


# ---- CEL rules ---------------------------------------------------------------------------------

_CEL_KEYWORDS = {
    "function",
    "in",
    "as",
    "break",
    "const",
    "continue",
    "else",
    "for",
    "if",
    "import",
    "let",
    "loop",
    "package",
    "namespace",
    "return",
    "var",
    "void",
    "while",
    "true",
    "false",
    "null",
}


def test_every_rule_is_attached_once_at_its_scope(root_schema: dict[str, Any]) -> None:
    spec = node_at(root_schema, "spec")
    attached = [(path, v) for path, node in walk(spec) for v in node.get("x-kubernetes-validations", [])]
    assert len(attached) == len(RULES) + len(UPDATE_RULES)
    for update in UPDATE_RULES:  # transition rules: on oldSelf, with no Python twin
        [validation] = [v for _, v in attached if v["message"] == update.message]
        assert "oldSelf" in validation["rule"] and validation["reason"] == "FieldValueForbidden"
    for rule in RULES:
        [(path, validation)] = [(p, v) for p, v in attached if v["message"] == rule.message]
        assert path == ("." + rule.scope if rule.scope else "")
        assert validation["fieldPath"] == rule.cel_field_path
        assert validation["reason"] == rule.reason
        node_at(node_at(spec, rule.scope), validation["fieldPath"])  # fieldPath names a real property
        if rule.create_only:
            assert validation["optionalOldSelf"] is True
            assert validation["rule"].startswith("oldSelf.hasValue() || (")
        else:
            assert "oldSelf" not in validation["rule"] and "optionalOldSelf" not in validation


# A field chain under `self` in a CEL rule, without a string method called on its end (`.startsWith(`).
CEL_FIELD_CHAIN = re.compile(r"\bself((?:\.[A-Za-z_][A-Za-z0-9_]*)+?)(?=\.[A-Za-z_][A-Za-z0-9_]*\(|[^.\w]|$)")


@pytest.mark.parametrize("rule", RULES, ids=[rule.name for rule in RULES])
def test_cel_references_only_existing_fields(root_schema: dict[str, Any], rule: Any) -> None:
    scope = node_at(node_at(root_schema, "spec"), rule.scope)
    chains = CEL_FIELD_CHAIN.findall(rule.cel)
    assert chains, rule.cel
    for chain in chains:
        node = scope
        for raw in chain.strip(".").split("."):
            name = raw[2:-2] if raw.startswith("__") and raw.endswith("__") else raw
            assert raw == name or name in _CEL_KEYWORDS, f"{raw} need not be escaped"
            assert name not in _CEL_KEYWORDS or raw != name, f"{name} is a CEL keyword: write __{name}__"
            assert name in node.get("properties", {}), f"{rule.name}: {chain} ({name})"
            node = node["properties"][name]


@pytest.mark.parametrize("rule", RULES, ids=[rule.name for rule in RULES])
def test_optional_fields_in_cel_are_guarded_by_has(root_schema: dict[str, Any], rule: Any) -> None:
    """Reading an unset field without a default is a CEL runtime error: guard it with has()."""
    scope = node_at(node_at(root_schema, "spec"), rule.scope)
    for chain in CEL_FIELD_CHAIN.findall(rule.cel):
        node, walked = scope, "self"
        for raw in chain.strip(".").split("."):
            name = raw[2:-2] if raw.startswith("__") else raw
            required = name in node.get("required", [])
            child = node["properties"][name]
            walked += "." + raw
            if not required and "default" not in child:
                assert f"has({walked})" in rule.cel, f"{rule.name}: {walked} may be unset"
            node = child


def test_docs_list_every_spec_field_and_rule(root_schema: dict[str, Any]) -> None:
    """docs/api.md has a row per spec field (by its path within its section) and one per rule."""
    docs = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    spec = node_at(root_schema, "spec")
    for section, node in spec["properties"].items():
        if "properties" not in node:
            assert f"| `{section}` |" in docs, section
            continue
        for path, _ in walk(node):
            parts = path.strip(".").split(".")
            if not path or "[]" in path or parts[-1] == "*":
                continue
            # Pod overrides and the optional placements (same shape as trainer.actor) get one row each.
            if (section == "pods" or (section == "trainer" and parts[0] != "actor")) and len(parts) > 1:
                continue
            assert f"| `{'.'.join(parts)}` |" in docs, f"spec.{section}.{'.'.join(parts)}"
    for rule in RULES:
        assert f"| `{rule.name}` | `{rule.field_path}` |" in docs, rule.name


# The words YAML 1.1 reads as booleans when bare: Kubernetes' YAML decoder (sigs.k8s.io/yaml) speaks
# YAML 1.1, so a property named one of them cannot be written as a key in a manifest (`n: 4` becomes
# `false: 4`) nor named in a CEL rule's fieldPath. A field of ours named `n` was refused by the API server.
YAML11_BOOLEANS = {"y", "n", "yes", "no", "on", "off", "true", "false"}


def _property_names(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.get("properties", {}).items():
            yield key
            yield from _property_names(value)
        for key in ("items", "additionalProperties"):
            if isinstance(node.get(key), dict):
                yield from _property_names(node[key])


def test_no_property_of_our_crds_is_a_word_yaml_11_reads_as_a_boolean() -> None:
    for built in (
        crd.build_crd(),
        *(crd.build_runtime_crd(kind) for kind in ("ClusterRLHFRuntime", "RLHFRuntime")),
    ):
        schema = built["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        bad = sorted({p for p in _property_names(schema) if p.lower() in YAML11_BOOLEANS})
        assert not bad, f"{built['metadata']['name']}: properties {bad} read as booleans by the API server"
