"""The Kubernetes core/v1 schemas that typed pod settings use (Volume, EnvVar, Toleration, Affinity, ...).

`pods.volumes` and the like are Kubernetes objects. The CRD types them with Kubernetes' own schemas, so
`kubectl explain` documents them and admission checks them, as controller-gen does for Go operators.
Those schemas come from the Kubernetes release the development cluster builds (its OpenAPI v3 document
in the Go module cache) and are stored resolved, pruned to the types named here, in `k8s_core_v1.json`:
`python -m rlhf_api.k8s_schemas --write` regenerates it. Nested descriptions are dropped to keep the CRD
small (each type appears once per pod role); a type's own fields keep the first sentence of theirs.
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import cache
from pathlib import Path
from typing import Any, Final

Schema = dict[str, Any]

KUBERNETES_VERSION: Final = "v1.36.3"
# The core/v1 types that pod settings hold, by their short name (the key in `k8s_core_v1.json`).
TYPES: Final = (
    "Affinity",
    "EnvFromSource",
    "EnvVar",
    "PodSecurityContext",
    "SecurityContext",
    "Toleration",
    "Volume",
    "VolumeMount",
)
STORED = Path(__file__).with_name("k8s_core_v1.json")
_PREFIX = "io.k8s.api.core.v1."
_OBJECT_META = "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"
# Keywords a structural CRD schema takes from the Kubernetes document; others (defaults, which the API
# server applies to the pod anyway, and documentation-only keys) are dropped.
_KEPT = (
    "type",
    "format",
    "enum",
    "x-kubernetes-int-or-string",
    "x-kubernetes-list-type",
    "x-kubernetes-list-map-keys",
    "x-kubernetes-map-type",
)


def openapi_document(version: str = KUBERNETES_VERSION) -> Path:
    """The core/v1 OpenAPI v3 document of `version` in the Go module cache (there once devcluster built)."""
    gopath = Path.home() / "go"
    path = gopath / "pkg" / "mod" / "k8s.io" / f"kubernetes@{version}" / "api" / "openapi-spec" / "v3"
    return path / "api__v1_openapi.json"


def _first_sentence(text: str) -> str:
    text = " ".join(text.split())
    end = text.find(". ")
    return text if end < 0 else text[: end + 1]


def _resolve(node: Any, defs: dict[str, Schema], trail: tuple[str, ...], depth: int) -> Any:
    """Inline `$ref`s (single-entry allOf wraps one), keep structural keywords; descriptions only at depth 1."""
    if not isinstance(node, dict):
        return node
    if "allOf" in node and len(node["allOf"]) == 1:
        rest = {k: v for k, v in node.items() if k != "allOf"}
        return {**_resolve(node["allOf"][0], defs, trail, depth), **_resolve(rest, defs, trail, depth)}
    if "$ref" in node:
        name = str(node["$ref"]).rsplit("/", 1)[-1]
        if name == _OBJECT_META:  # in an embedded template only labels and annotations matter
            string_map = {"type": "object", "additionalProperties": {"type": "string"}}
            return {"type": "object", "properties": {"annotations": string_map, "labels": string_map}}
        if name in trail:
            raise ValueError(f"recursive Kubernetes schema {' -> '.join((*trail, name))}")
        return _resolve(defs[name], defs, (*trail, name), depth)
    out: Schema = {k: node[k] for k in _KEPT if k in node}
    if "oneOf" in node or "anyOf" in node:  # IntOrString and Quantity
        out["x-kubernetes-int-or-string"] = True
        out.pop("type", None)
    if depth == 1 and node.get("description"):
        out["description"] = _first_sentence(str(node["description"]))
    if "properties" in node:
        out["type"] = "object"
        out["properties"] = {
            k: _resolve(v, defs, trail, depth + 1) for k, v in sorted(node["properties"].items())
        }
        if node.get("required"):
            out["required"] = sorted(node["required"])
    elif isinstance(node.get("additionalProperties"), dict):
        out["additionalProperties"] = _resolve(node["additionalProperties"], defs, trail, depth + 1)
    elif out.get("type") == "object":  # free-form in Kubernetes too (none in TYPES today)
        out["x-kubernetes-preserve-unknown-fields"] = True
    if "items" in node:
        out["items"] = _resolve(node["items"], defs, trail, depth + 1)
    return out


def extract(document: Schema) -> dict[str, Schema]:
    """The resolved, pruned schema of each type in TYPES from a Kubernetes OpenAPI v3 document."""
    defs: dict[str, Schema] = document["components"]["schemas"]
    return {name: _resolve(defs[_PREFIX + name], defs, (_PREFIX + name,), 0) for name in TYPES}


@cache
def stored() -> dict[str, Schema]:
    """The schemas as generated into the package (what the CRD generator and `rlhf validate` read)."""
    data: dict[str, Schema] = json.loads(STORED.read_text())
    return data


def schema(name: str) -> Schema:
    """One stored core/v1 type's schema, e.g. `schema("Volume")`."""
    return stored()[name]


_JSON_TYPES: Final[dict[str, tuple[type, ...]]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "object": (dict,),
    "array": (list,),
}


def problems(value: Any, node: Schema, path: str = "") -> list[str]:
    """What the API server would reject in `value` under the structural schema `node`, as `path: why`.

    Unknown fields count as errors, as under kubectl's default strict field validation.
    """
    where = path or "(value)"
    if node.get("x-kubernetes-int-or-string"):
        ok = isinstance(value, int | str) and not isinstance(value, bool)
        return [] if ok else [f"{where}: expected an integer or a string"]
    kind = node.get("type")
    if kind is not None:
        expected = _JSON_TYPES[str(kind)]
        if not isinstance(value, expected) or (kind != "boolean" and isinstance(value, bool)):
            return [f"{where}: expected {'an' if str(kind)[0] in 'aeio' else 'a'} {kind}"]
    if "enum" in node and value not in node["enum"]:
        return [f"{where}: {value!r} is not one of {node['enum']}"]
    found: list[str] = []
    if isinstance(value, dict):
        props = node.get("properties")
        for key in node.get("required", []):
            if key not in value:
                found.append(f"{path}.{key}: required" if path else f"{key}: required")
        for key, item in value.items():
            sub = f"{path}.{key}" if path else str(key)
            if props is not None:
                if key not in props:
                    found.append(f"{sub}: unknown field")
                else:
                    found.extend(problems(item, props[key], sub))
            elif isinstance(node.get("additionalProperties"), dict):
                found.extend(problems(item, node["additionalProperties"], sub))
    if isinstance(value, list) and "items" in node:
        for i, item in enumerate(value):
            found.extend(problems(item, node["items"], f"{path}[{i}]"))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--document", type=Path, default=None, help="core/v1 OpenAPI v3 JSON to read")
    parser.add_argument("--write", action="store_true", help=f"write {STORED.name}")
    args = parser.parse_args(argv)
    path = args.document or openapi_document()
    if not path.exists():
        print(
            f"error: {path} is missing: build the control plane first (make cluster-build puts "
            f"k8s.io/kubernetes@{KUBERNETES_VERSION} in the Go module cache) or pass --document",
            file=sys.stderr,
        )
        return 1
    text = json.dumps(extract(json.loads(path.read_text())), indent=1, sort_keys=True) + "\n"
    if args.write:
        STORED.write_text(text)
        print(f"wrote {STORED} ({len(text)} bytes) from {path}")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
