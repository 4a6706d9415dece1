"""Every default the docs state is the spec model's default: api.md's tables and the prose of every doc.

The expected values come from one table generated here from the model (through the CRD schema the
model generates, which is what the API server applies), never typed by hand, so docs and model cannot
drift apart unnoticed: a `docs/reliability.md` that called `onError: skipSample` the default while the
model said `failStep` fails here.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from rlhf_api.crd import spec_schema

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
DOCS = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]


def fields(
    node: dict[str, Any], path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], dict[str, Any], bool]]:
    """(path, schema node, required) of every property under node."""
    required = set(node.get("required", []))
    for name, child in node.get("properties", {}).items():
        yield (*path, name), child, name in required
        yield from fields(child, (*path, name))


def rendered(node: dict[str, Any], required: bool) -> str:
    """How api.md's default column shows a field's default."""
    if "default" in node:
        return "(defaults below)" if node.get("type") == "object" else f"`{json.dumps(node['default'])}`"
    return "**required**" if required else "unset"


@pytest.fixture(scope="module")
def table() -> dict[str, tuple[dict[str, Any], str]]:
    """spec path (dotted) -> (schema node, default as api.md renders it), for every spec field."""
    return {".".join(p): (node, rendered(node, req)) for p, node, req in fields(spec_schema())}


def test_api_md_default_column_is_the_models(table: dict[str, tuple[dict[str, Any], str]]) -> None:
    section: str | None = None
    checked, wrong = 0, []
    for line in (ROOT / "docs" / "api.md").read_text(encoding="utf-8").splitlines():
        if line.startswith("## "):
            section = None
        if m := re.match(r"### `spec(?:\.([\w.]+))?`", line):
            section = m.group(1) or ""
            continue
        m = re.match(r"\| `([\w.]+)` \| [^|]* \| ([^|]*) \|", line)
        if section is None or not m:
            continue
        path = f"{section}.{m.group(1)}".strip(".")
        assert path in table, f"docs/api.md documents spec.{path}, which the model does not have"
        checked += 1
        if m.group(2).strip() != table[path][1]:
            wrong.append(f"spec.{path}: docs say {m.group(2).strip()}, the model {table[path][1]}")
    assert checked >= 80, f"only {checked} rows of docs/api.md read: has its table format changed?"
    assert not wrong, "\n".join(wrong)


def literal(value: str) -> Any:
    value = value.strip("` ")
    try:
        return json.loads(value)
    except ValueError:
        return value


def claims(text: str) -> Iterator[tuple[str | None, str]]:
    """(field name or None, value) of each default a doc's prose states.

    `field: value` (the default) / `field` (default value) / `value` (default) in a list of choices.
    """
    for m in re.finditer(r"`([\w.]+): ([^`]+)`\s+\((?:the )?default\)", text):
        yield m.group(1).rsplit(".", 1)[-1], m.group(2)
    for m in re.finditer(r"`([\w.]+)`\s+\(default (`?[\w.\-]+`?)[;)]", text):
        yield m.group(1).rsplit(".", 1)[-1], m.group(2)
    for m in re.finditer(r"^\s*- `(\w+)` \((?:the )?default\)", text, re.MULTILINE):
        yield None, m.group(1)


def test_defaults_stated_in_the_docs_prose_are_the_models(
    table: dict[str, tuple[dict[str, Any], str]],
) -> None:
    by_leaf: dict[str, list[dict[str, Any]]] = {}
    for path, (node, _) in table.items():
        by_leaf.setdefault(path.rsplit(".", 1)[-1], []).append(node)
    checked, wrong = 0, []
    for doc in DOCS:
        for name, raw in claims(doc.read_text(encoding="utf-8")):
            value = literal(raw)
            if name is None:  # a choice called the default: the field whose choices include it
                nodes = [n for ns in by_leaf.values() for n in ns if value in n.get("enum", [])]
            else:
                nodes = by_leaf.get(name, [])
            if not nodes or (isinstance(value, str) and raw.startswith("`") and value in by_leaf):
                continue  # not a spec field (an env var, a chart value), or a default that names a field
            checked += 1
            defaults = [n.get("default") for n in nodes]
            if value not in defaults:
                wrong.append(f"{doc.relative_to(ROOT)}: {name or '?'} default {raw!r}; the model: {defaults}")
    assert checked >= 5, f"only {checked} stated defaults found: has the docs' phrasing changed?"
    assert not wrong, "\n".join(wrong)
