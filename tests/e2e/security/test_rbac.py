"""The operator's RBAC as the chart renders it, in both modes: no wildcards, and Secrets exactly as
docs/security.md says (create, nothing else: no get, list, watch or update, by any rule)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from testkit.chart_tools import ROOT, render

pytestmark = pytest.mark.security

MODES = {"cluster-wide": [], "watch-namespaces": ["--set-json", f"watchNamespaces={json.dumps(['a', 'b'])}"]}


def rules(objects: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    return [
        (o["metadata"]["name"], rule)
        for o in objects
        if o["kind"] in {"ClusterRole", "Role"}
        for rule in o.get("rules") or []
    ]


@pytest.mark.parametrize("mode", list(MODES))
def test_rbac_has_no_wildcards_and_only_creates_secrets(mode: str) -> None:
    objects = render(*MODES[mode], "--set", "rbac.aggregateToDefaultRoles=false")
    found = rules(objects)
    assert found
    secret_rules = []
    for role, rule in found:
        for key in ("apiGroups", "resources", "verbs", "resourceNames", "nonResourceURLs"):
            assert "*" not in rule.get(key, []), f"{role}: wildcard in {key}: {rule}"
        assert not {"escalate", "bind", "impersonate"} & set(rule["verbs"]), (role, rule)
        assert "serviceaccounts/token" not in rule.get("resources", []), (role, rule)
        if "" in rule["apiGroups"] and "secrets" in rule["resources"]:
            secret_rules.append((role, rule))
    # One rule per operator role that grants the job rules (one ClusterRole, or a Role per namespace).
    expected = 1 if mode == "cluster-wide" else 2
    assert len(secret_rules) == expected, secret_rules
    for role, rule in secret_rules:
        assert rule == {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]}, (role, rule)


def test_the_docs_state_the_secret_access_the_chart_grants() -> None:
    text = (ROOT / "docs" / "security.md").read_text()
    assert "`create` on `secrets`" in text and "never reads" in text
