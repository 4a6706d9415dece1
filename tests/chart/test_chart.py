"""The Helm chart without a cluster: lint, rendering, values schema, RBAC, security, monitoring, README.

Runs helm (and promtool for the dashboard's queries); a missing tool fails the test naming it.
"""

from __future__ import annotations

import ast
import importlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from testkit.chart_tools import (
    CHART,
    KUBE_VERSION,
    MONITORING_API,
    NAMESPACE,
    RELEASE,
    ROOT,
    by_kind,
    dump_yaml,
    helm_template,
    monitoring_args,
    one,
    render,
    run,
    tool,
)

pytestmark = pytest.mark.unit

MONITORING_KINDS = {"PrometheusRule", "ServiceMonitor", "PodMonitor"}
RBAC_KINDS = {"ClusterRole", "Role"}
WATCHED = ["team-a", "team-b"]
WATCH_ARGS = ["--set-json", f"watchNamespaces={json.dumps(WATCHED)}"]
GPU_IB = ["--set", "runtimes.gpuIB.enabled=true"]  # the example GPU runtime, off by default

# What the operator's ServiceAccount may do in each namespace it watches (cluster-wide: everywhere).
# Any change here is a change of the operator's privileges: docs/chart.md explains each rule.
OPERATOR_NAMESPACED_RULES = {
    ("rlhf.dev", "rlhfjobs"): {"get", "list", "watch", "patch", "update", "delete"},
    ("rlhf.dev", "rlhfjobs/status"): {"get", "patch", "update"},
    ("rlhf.dev", "rlhfjobs/finalizers"): {"update"},
    ("ray.io", "rayclusters"): {"get", "list", "watch", "create", "patch", "update", "delete"},
    ("ray.io", "rayclusters/status"): {"get"},
    ("kueue.x-k8s.io", "workloads"): {"get", "list"},  # a queued job's reason (docs/kueue.md)
    ("", "pods"): {"get", "list", "watch"},
    ("", "pods/log"): {"get"},  # the fetch-models step's progress (docs/models.md)
    ("", "services"): {"get", "list", "watch"},
    ("", "secrets"): {"create"},  # each job's Ray token (docs/security.md; tests/e2e/security/test_rbac.py)
    ("networking.k8s.io", "networkpolicies"): {"create"},
    # <job>-stacks, a stall's stack snapshot (docs/monitoring.md); <job>-runtime, a job's runtime copy
    ("", "configmaps"): {"get", "create", "update"},
    ("", "events"): {"create", "patch"},
    ("events.k8s.io", "events"): {"create", "patch"},
    ("rlhf.dev", "rlhfruntimes"): {"get"},  # a job's namespaced runtime, read when it is bound
    ("", "persistentvolumeclaims"): {"create"},  # a runtime's per-job checkpoint claim
}
CRD_READ = {("apiextensions.k8s.io", "customresourcedefinitions"): {"list", "watch"}}
# Cluster-scoped, so granted by a ClusterRole in both modes: the CRD watch and a job's ClusterRLHFRuntime.
OPERATOR_CLUSTER_RULES = CRD_READ | {("rlhf.dev", "clusterrlhfruntimes"): {"get"}}
# kopf with a namespace list also lists and watches namespaces (test_chart_cluster.py runs it).
NAMESPACE_READ = {("", "namespaces"): {"list", "watch"}}
# The leader election's Lease, in the release namespace (test_replicas_elect_a_leader... checks the Role).
LEADER_RULES = {("coordination.k8s.io", "leases"): {"create", "get", "update"}}

# The operator's own Kubernetes client calls, read from its source (client_calls); kopf's watches, patches
# and Events are not among them and are in the tables above by hand.
OPERATOR_SOURCE = ROOT / "operator" / "rlhf_operator"
NOT_THE_OPERATOR = {"diagnose_cli.py"}  # `rlhf diagnose` runs with its user's kubeconfig
CLIENT_VERBS = {"read": "get", "get": "get", "list": "list", "create": "create", "replace": "update"}
CLIENT_VERBS |= {"patch": "patch", "delete": "delete"}
CUSTOM_CALL = re.compile(r"^(get|list|create|replace|patch|delete)_(namespaced|cluster)_custom_object$")
TYPED_CALL = re.compile(r"^(read|list|create|replace|patch|delete)_namespaced_([a-z_]+)$")
TYPED_RESOURCES = {
    "config_map": ("", "configmaps"),
    "secret": ("", "secrets"),
    "pod": ("", "pods"),
    "pod_log": ("", "pods/log"),
    "service": ("", "services"),
    "persistent_volume_claim": ("", "persistentvolumeclaims"),
    "network_policy": ("networking.k8s.io", "networkpolicies"),
    "lease": ("coordination.k8s.io", "leases"),
}


def kinds(objects: list[dict[str, Any]]) -> set[str]:
    return {o["kind"] for o in objects}


def rule_table(role: dict[str, Any]) -> dict[tuple[str, str], set[str]]:
    table: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                table.setdefault((group, resource), set()).update(rule["verbs"])
    return table


def leader_rbac(obj: dict[str, Any]) -> bool:
    """The leader election's Role or RoleBinding (test_replicas_elect_a_leader... checks them)."""
    return str(obj["metadata"]["name"]).endswith("-leader-election")


def operator_cluster_roles(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ClusterRoles bound to the operator's ServiceAccount (not the roles for people)."""
    sa = one(objects, "ServiceAccount")["metadata"]["name"]
    subject = {"kind": "ServiceAccount", "name": sa, "namespace": NAMESPACE}
    bound = {b["roleRef"]["name"] for b in by_kind(objects, "ClusterRoleBinding") if subject in b["subjects"]}
    return [r for r in by_kind(objects, "ClusterRole") if r["metadata"]["name"] in bound]


def deployment(*args: str) -> dict[str, Any]:
    return one(render(*args), "Deployment")


def container(dep: dict[str, Any]) -> dict[str, Any]:
    containers = dep["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    c: dict[str, Any] = containers[0]
    return c


# ---- lint and render ---------------------------------------------------------------------------


# `helm lint` has no --api-versions, so it lints the monitoring values without the monitoring objects;
# those are rendered and checked below (and by promtool in tests/alert_rules).
@pytest.mark.parametrize(
    "values",
    [[], monitoring_args(api=False), [*WATCH_ARGS, *monitoring_args(api=False)], GPU_IB],
    ids=["defaults", "monitoring", "watch-namespaces+monitoring", "gpu-runtime"],
)
@pytest.mark.parametrize("strict", [False, True], ids=["lint", "lint-strict"])
def test_helm_lint(values: list[str], strict: bool) -> None:
    cmd: list[str | Path] = [
        tool("helm"),
        "lint",
        CHART,
        "--kube-version",
        KUBE_VERSION,
        *(["--strict"] if strict else []),
        *values,
    ]
    proc = run(cmd)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))}:\n{proc.stdout}\n{proc.stderr}"
    assert "1 chart(s) linted, 0 chart(s) failed" in proc.stdout
    assert "[WARNING]" not in proc.stdout and "[ERROR]" not in proc.stdout, proc.stdout


def test_default_render() -> None:
    objects = render()
    assert kinds(objects) == {
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "Role",  # the leader election's Lease, in the release namespace
        "RoleBinding",
        "Service",
        "Deployment",
        "Secret",  # the key of the jobs' Ray tokens (templates/ray-token-key.yaml)
        "ClusterRLHFRuntime",  # runtimes.cpuDev (templates/runtimes.yaml)
    }
    for obj in objects:
        labels = obj["metadata"]["labels"]
        assert labels["app.kubernetes.io/instance"] == RELEASE, obj["metadata"]["name"]
        assert labels["app.kubernetes.io/managed-by"] == "Helm"
        if obj["kind"] not in {"ClusterRole", "ClusterRoleBinding", "ClusterRLHFRuntime"}:
            assert obj["metadata"]["namespace"] == NAMESPACE, obj["metadata"]["name"]


def test_monitoring_objects_only_with_the_prometheus_operator_api() -> None:
    without = render(*monitoring_args(api=False))
    assert not kinds(without) & MONITORING_KINDS, (
        "monitoring objects rendered without monitoring.coreos.com/v1"
    )
    with_api = render(*monitoring_args(api=True))
    assert kinds(with_api) >= MONITORING_KINDS
    # The dashboard is a plain ConfigMap for Grafana's sidecar: its own switch, no Prometheus Operator needed.
    for objects in (without, with_api):
        assert [c["metadata"]["name"] for c in by_kind(objects, "ConfigMap")] == [f"{RELEASE}-dashboard"]


def test_monitoring_is_off_by_default() -> None:
    objects = render("--api-versions", MONITORING_API)
    assert not kinds(objects) & (MONITORING_KINDS | {"ConfigMap"})


# ---- values schema -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "path"),
    [
        (["--set", "replicaCount=-1"], "/replicaCount"),
        (["--set", "replicaCount=3"], "/replicaCount"),
        (["--set", "unknownKey=1"], "unknownKey"),
        (["--set", "image.tag=1", "--set", "image.tga=2"], "tga"),
        (["--set", "watchNamespaces=x"], "/watchNamespaces"),
        (["--set-json", 'watchNamespaces=["Team_A"]'], "/watchNamespaces/0"),
        (["--set-json", 'watchNamespaces=["a","a"]'], "/watchNamespaces"),
        (["--set", "image.pullPolicy=Sometimes"], "/image/pullPolicy"),
        (["--set", "operator.logFormat=xml"], "/operator/logFormat"),
        (["--set", "operator.healthPort=0"], "/operator/healthPort"),
        (["--set", "metrics.serviceMonitor.interval=30"], "/metrics/serviceMonitor/interval"),
        (
            ["--set", "metrics.prometheusRule.weightSyncShareThreshold=1.5"],
            "/metrics/prometheusRule/weightSyncShareThreshold",
        ),
        (
            ["--set-json", "metrics.prometheusRule.weightSyncShareThreshold=0"],
            "/metrics/prometheusRule/weightSyncShareThreshold",
        ),
        (
            ["--set", "metrics.prometheusRule.alerts.RLHFJobFailed.severity=page"],
            "/metrics/prometheusRule/alerts/RLHFJobFailed/severity",
        ),
        (["--set", "metrics.prometheusRule.alerts.RLHFJobFailled.enabled=false"], "RLHFJobFailled"),
        (["--set", "runtimes.cpuDev.name=CPU_Dev"], "/runtimes/cpuDev/name"),
        (["--set", "runtimes.gpuIB.enabled=yes"], "/runtimes/gpuIB/enabled"),
        (["--set", "runtimes.cpuDev.spec.image=x"], "/runtimes/cpuDev/spec"),
        (["--set-json", 'runtimes.extra=[{"spec":{}}]'], "/runtimes/extra/0"),
        (["--set", "runtimes.readableByAll=sometimes"], "/runtimes/readableByAll"),
    ],
    ids=lambda v: v if isinstance(v, str) else " ".join(v),
)
def test_bad_values_fail_naming_the_value(args: list[str], path: str) -> None:
    proc = helm_template(*args)
    assert proc.returncode != 0, f"helm template {' '.join(args)} rendered; the schema should reject it"
    assert "values don't meet the specifications of the schema" in proc.stderr, proc.stderr
    assert path in proc.stderr, f"the error does not name {path}:\n{proc.stderr}"


def test_schema_accepts_the_documented_examples() -> None:
    render(
        *WATCH_ARGS,
        *monitoring_args(),
        "--set",
        "replicaCount=0",
        "--set",
        "image.digest=sha256:" + "ab" * 32,
        *GPU_IB,
        "--set-json",
        'runtimes.extra=[{"name":"team-x","spec":{"rayVersion":"2.60.0"}}]',
        "--set",
        "runtimes.readableByAll=false",
    )


# ---- RBAC ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [[], WATCH_ARGS], ids=["cluster-wide", "watch-namespaces"])
def test_rbac_has_no_wildcards_and_reads_no_secrets(mode: list[str]) -> None:
    roles = [o for o in render(*mode) if o["kind"] in RBAC_KINDS]
    assert roles
    for role in roles:
        for rule in role["rules"]:
            for key in ("apiGroups", "resources", "verbs", "resourceNames", "nonResourceURLs"):
                assert "*" not in rule.get(key, []), f"{role['metadata']['name']}: wildcard in {key}: {rule}"
            assert "serviceaccounts/token" not in rule.get("resources", []), (
                f"{role['metadata']['name']}: {rule}"
            )
            if "configmaps" in rule.get("resources", []):  # the operator's own, read by name: never listed
                assert rule["verbs"] == ["get", "create", "update"], f"{role['metadata']['name']}: {rule}"
            if "secrets" in rule.get("resources", []):
                assert rule["verbs"] == ["create"], f"{role['metadata']['name']}: {rule}"
            assert not {"escalate", "bind", "impersonate"} & set(rule["verbs"]), rule


def test_the_ray_token_key_is_made_once_or_named() -> None:
    objects = render()
    secret = one(objects, "Secret")
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert len(secret["data"]["key"]) >= 64  # base64 of 64 random characters
    dep = one(objects, "Deployment")
    env = {e["name"]: e.get("value") for e in container(dep)["env"]}
    assert env["RLHF_RAY_TOKEN_KEY_FILE"] == "/etc/rlhf-operator/ray-token-key/key"
    assert json.loads(env["RLHF_OPERATOR_POD_LABELS"]) == {
        "app.kubernetes.io/name": "rlhf-operator",
        "app.kubernetes.io/instance": RELEASE,
    }
    assert json.loads(env["RLHF_METRICS_FROM"]) == []
    volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    assert volumes["ray-token-key"]["secret"]["secretName"] == secret["metadata"]["name"]

    peers = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    named = render(
        "--set",
        "security.rayTokenKey.existingSecret=mine",
        "--set-json",
        f"security.networkPolicy.metricsFrom={json.dumps(peers)}",
    )
    assert not by_kind(named, "Secret")
    dep = one(named, "Deployment")
    volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    assert volumes["ray-token-key"]["secret"]["secretName"] == "mine"
    env = {e["name"]: e.get("value") for e in container(dep)["env"]}
    assert json.loads(env["RLHF_METRICS_FROM"]) == peers


def test_cluster_wide_rbac_is_exactly_what_the_operator_uses() -> None:
    objects = render("--set", "rbac.aggregateToDefaultRoles=false")
    (role,) = operator_cluster_roles(objects)
    assert rule_table(role) == OPERATOR_NAMESPACED_RULES | OPERATOR_CLUSTER_RULES
    (binding,) = [
        b for b in by_kind(objects, "ClusterRoleBinding") if b["roleRef"]["name"] == role["metadata"]["name"]
    ]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": role["metadata"]["name"],
    }
    sa = one(objects, "ServiceAccount")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": NAMESPACE}
    ]
    assert not [o for o in by_kind(objects, "Role") + by_kind(objects, "RoleBinding") if not leader_rbac(o)]
    assert "--all-namespaces" in container(one(objects, "Deployment"))["args"]


def test_watch_namespaces_rbac_is_per_namespace() -> None:
    objects = render(*WATCH_ARGS, "--set", "rbac.aggregateToDefaultRoles=false")
    sa_name = one(objects, "ServiceAccount")["metadata"]["name"]
    roles = {r["metadata"]["namespace"]: r for r in by_kind(objects, "Role") if not leader_rbac(r)}
    bindings = {b["metadata"]["namespace"]: b for b in by_kind(objects, "RoleBinding") if not leader_rbac(b)}
    assert sorted(roles) == sorted(bindings) == WATCHED
    for ns in WATCHED:
        assert rule_table(roles[ns]) == OPERATOR_NAMESPACED_RULES
        assert bindings[ns]["roleRef"]["kind"] == "Role"
        assert bindings[ns]["roleRef"]["name"] == roles[ns]["metadata"]["name"]
        assert bindings[ns]["subjects"] == [
            {"kind": "ServiceAccount", "name": sa_name, "namespace": NAMESPACE}
        ]
    # Cluster-wide, only the CRD and namespace reads that kopf makes in this mode, and the jobs'
    # ClusterRLHFRuntimes (cluster-scoped: no Role can grant them).
    (cluster_role,) = operator_cluster_roles(objects)
    assert rule_table(cluster_role) == OPERATOR_CLUSTER_RULES | NAMESPACE_READ
    args = container(one(objects, "Deployment"))["args"]
    assert "--all-namespaces" not in args
    assert [args[i + 1] for i, a in enumerate(args) if a == "--namespace"] == WATCHED


def test_user_roles_aggregate_into_the_default_roles() -> None:
    roles = {r["metadata"]["name"]: r for r in by_kind(render(), "ClusterRole")}
    edit = roles[f"{NAMESPACE}-{RELEASE}-edit"]
    view = roles[f"{NAMESPACE}-{RELEASE}-view"]
    assert edit["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-edit"] == "true"
    assert view["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-view"] == "true"
    assert rule_table(view) == {
        ("rlhf.dev", r): {"get", "list", "watch"}
        for r in ("rlhfjobs", "rlhfjobs/status", "rlhfjobs/scale", "rlhfruntimes")
    }
    assert "create" in rule_table(edit)[("rlhf.dev", "rlhfjobs")]
    assert {"create", "update", "delete"} <= rule_table(edit)[("rlhf.dev", "rlhfruntimes")]
    # A namespaced role cannot grant a cluster-scoped resource: ClusterRLHFRuntimes are not in them.
    for role in (edit, view):
        assert ("rlhf.dev", "clusterrlhfruntimes") not in rule_table(role)
    # Nothing binds them: they only extend the built-in roles that people are given.
    for binding in by_kind(render(), "ClusterRoleBinding"):
        assert binding["roleRef"]["name"] not in {edit["metadata"]["name"], view["metadata"]["name"]}


def test_every_user_may_read_cluster_runtimes_unless_switched_off() -> None:
    name = f"{NAMESPACE}-{RELEASE}-runtime-reader"
    objects = render()
    (reader,) = [r for r in by_kind(objects, "ClusterRole") if r["metadata"]["name"] == name]
    assert rule_table(reader) == {("rlhf.dev", "clusterrlhfruntimes"): {"get", "list", "watch"}}
    (binding,) = [b for b in by_kind(objects, "ClusterRoleBinding") if b["metadata"]["name"] == name]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": name,
    }
    assert binding["subjects"] == [
        {"apiGroup": "rbac.authorization.k8s.io", "kind": "Group", "name": "system:authenticated"}
    ]
    # The only grant to a group: every other binding names the operator's ServiceAccount.
    assert [
        b for b in by_kind(objects, "ClusterRoleBinding") if b["subjects"][0]["kind"] != "ServiceAccount"
    ] == [binding]
    off = render("--set", "runtimes.readableByAll=false")
    assert name not in {o["metadata"]["name"] for o in off if o["kind"].startswith("ClusterRole")}


def test_rbac_matches_the_crd() -> None:
    """The RBAC names the CRDs' group and plurals, the subresources the job CRD serves, and grants each
    runtime where its scope says: namespaced in the per-namespace rules, cluster-scoped in a ClusterRole."""

    def crd(name: str) -> dict[str, Any]:
        found: dict[str, Any] = yaml.safe_load((CHART / "crds" / f"{name}.yaml").read_text())
        assert found["kind"] == "CustomResourceDefinition" and found["metadata"]["name"] == name
        return found

    job = crd("rlhfjobs.rlhf.dev")
    group, plural = job["spec"]["group"], job["spec"]["names"]["plural"]
    served = [v for v in job["spec"]["versions"] if v.get("served")]
    assert served and all({"status", "scale"} <= v.get("subresources", {}).keys() for v in served)
    namespaced, cluster = crd("rlhfruntimes.rlhf.dev"), crd("clusterrlhfruntimes.rlhf.dev")
    assert namespaced["spec"]["scope"] == "Namespaced" and cluster["spec"]["scope"] == "Cluster"
    granted = {key for key in OPERATOR_NAMESPACED_RULES if key[0] == group}
    assert granted == {
        (group, plural),
        (group, f"{plural}/status"),
        (group, f"{plural}/finalizers"),
        (group, namespaced["spec"]["names"]["plural"]),
    }
    assert {key for key in OPERATOR_CLUSTER_RULES if key[0] == group} == {
        (group, cluster["spec"]["names"]["plural"])
    }


def _constant(node: ast.expr, module: Any, where: str) -> str:
    """The value of a call argument that names a constant: `PLURAL` or `kube.RAY_PLURAL`."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Name):
        return str(getattr(module, node.id))
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        return str(getattr(getattr(module, node.value.id), node.attr))
    raise AssertionError(f"{where}: cannot tell the API group or plural from {ast.unparse(node)}")


def client_calls() -> dict[str, dict[tuple[str, str], set[str]]]:
    """{"namespaced" | "cluster": {(API group, resource): verbs}} of the Kubernetes client calls in the
    operator's source: the typed core calls by their name, the custom-object calls by their arguments."""
    found: dict[str, dict[tuple[str, str], set[str]]] = {"namespaced": {}, "cluster": {}}
    for path in sorted(OPERATOR_SOURCE.glob("*.py")):
        if path.name in NOT_THE_OPERATOR:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            where = f"{path.name}:{node.lineno} {node.func.attr}"
            if custom := CUSTOM_CALL.match(node.func.attr):
                module = importlib.import_module(f"rlhf_operator.{path.stem}")
                scope, plural_at = ("cluster", 2) if custom[2] == "cluster" else ("namespaced", 3)
                assert len(node.args) > plural_at, f"{where}: pass the group and plural by position"
                key = (_constant(node.args[0], module, where), _constant(node.args[plural_at], module, where))
                verb = custom[1]
            elif typed := TYPED_CALL.match(node.func.attr):
                assert typed[2] in TYPED_RESOURCES, f"{where}: add its resource to TYPED_RESOURCES"
                scope, key, verb = "namespaced", TYPED_RESOURCES[typed[2]], typed[1]
            else:
                continue
            found[scope].setdefault(key, set()).add(CLIENT_VERBS[verb])
    return found


def test_every_client_call_of_the_operator_is_granted() -> None:
    """A call added to the operator without its rule in the tables (which the tests above hold the chart
    to) fails here, naming the resource and verb."""
    calls = client_calls()
    # The scan sees the calls it must: one that found nothing would pass anything.
    assert "get" in calls["cluster"][("rlhf.dev", "clusterrlhfruntimes")]
    assert "get" in calls["namespaced"][("", "configmaps")]
    assert "create" in calls["namespaced"][("ray.io", "rayclusters")]
    granted = {"namespaced": OPERATOR_NAMESPACED_RULES | LEADER_RULES, "cluster": OPERATOR_CLUSTER_RULES}
    missing = {
        (scope, key): sorted(verbs - granted[scope].get(key, set()))
        for scope, table in calls.items()
        for key, verbs in table.items()
        if verbs - granted[scope].get(key, set())
    }
    assert not missing, f"the operator calls these without RBAC: {missing}"


def test_rbac_objects_can_be_left_out() -> None:
    objects = render(
        "--set",
        "rbac.create=false",
        "--set",
        "serviceAccount.create=false",
        "--set",
        "serviceAccount.name=existing",
    )
    assert not kinds(objects) & {"ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding", "ServiceAccount"}
    assert one(objects, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == "existing"


def test_two_releases_in_two_namespaces_do_not_share_cluster_objects() -> None:
    def cluster_rbac(namespace: str) -> set[str]:
        return {
            o["metadata"]["name"] for o in render(namespace=namespace) if o["kind"].startswith("ClusterRole")
        }

    names_a, names_b = cluster_rbac("ns-a"), cluster_rbac("ns-b")
    assert names_a and not names_a & names_b
    # Except the runtimes: their names are what jobs write, so a second release names its own or makes
    # none (runtimes.cpuDev.enabled=false); Helm refuses an object another release owns.
    (runtime,) = by_kind(render(namespace="ns-b"), "ClusterRLHFRuntime")
    assert runtime["metadata"]["name"] == "cpu-dev"


# ---- runtimes ------------------------------------------------------------------------------------


def chart_runtimes(*args: str) -> dict[str, dict[str, Any]]:
    """The rendered ClusterRLHFRuntimes by name, each checked as the operator checks a runtime it binds:
    the model (the CRD's schema comes from it) and the runtime rules (the CRD's CEL)."""
    from rlhf_api.runtime_spec import ClusterRLHFRuntime, runtime_violations

    found = {}
    for obj in by_kind(render(*args), "ClusterRLHFRuntime"):
        assert "namespace" not in obj["metadata"], "ClusterRLHFRuntime is cluster-scoped"
        assert obj["metadata"]["labels"]["app.kubernetes.io/instance"] == RELEASE
        runtime = ClusterRLHFRuntime.model_validate(obj)
        assert not runtime_violations(runtime.spec), [r.message for r in runtime_violations(runtime.spec)]
        found[runtime.name] = obj
    return found


def trainer_image() -> str:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    return f"ghcr.io/rlhf-operator/trainer:{chart['appVersion']}"


def test_the_default_runtime_is_cpu_dev_on_the_trainer_image() -> None:
    runtimes = chart_runtimes()
    assert list(runtimes) == ["cpu-dev"]
    assert runtimes["cpu-dev"]["spec"] == {"images": {"cpu": trainer_image()}}
    tagged = chart_runtimes("--set", "jobDefaults.trainerImage.tag=cpu-1")
    assert tagged["cpu-dev"]["spec"]["images"]["cpu"] == "ghcr.io/rlhf-operator/trainer:cpu-1"
    assert chart_runtimes("--set", "runtimes.cpuDev.enabled=false") == {}


def test_the_gpu_example_runtime() -> None:
    runtimes = chart_runtimes(*GPU_IB)
    assert sorted(runtimes) == ["cpu-dev", "h100-ib"]
    spec = runtimes["h100-ib"]["spec"]
    assert spec["images"] == {"cpu": trainer_image(), "gpu": f"{trainer_image()}-gpu"}
    fabric = spec["pods"]["fabric"]
    assert fabric["resources"]["limits"] == {"rdma/ib": 1}
    assert {e["name"] for e in fabric["env"]} == {"NCCL_IB_HCA", "NCCL_SOCKET_IFNAME"}
    assert "k8s.v1.cni.cncf.io/networks" in fabric["annotations"]
    assert fabric["containerSecurityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
    assert fabric["nodeSelector"] and fabric["tolerations"]
    assert "head" not in spec["pods"], "the head needs no GPU node"
    assert set(spec["storage"]["checkpoints"]["claimTemplate"]) >= {"size", "accessModes"}


def test_a_runtime_spec_value_merges_over_the_charts() -> None:
    runtimes = chart_runtimes(
        *GPU_IB,
        "--set-json",
        'runtimes.cpuDev.spec={"pods":{"nodeSelector":{"a":"b"}}}',
        "--set-json",
        'runtimes.gpuIB.spec={"images":{"gpu":"registry.example/t:gpu-1"},'
        '"pods":{"fabric":{"nodeSelector":{"pool":"h100"},"env":[{"name":"NCCL_DEBUG","value":"INFO"}]}}}',
        "--set",
        "runtimes.gpuIB.name=h100",
    )
    assert runtimes["cpu-dev"]["spec"] == {
        "images": {"cpu": trainer_image()},
        "pods": {"nodeSelector": {"a": "b"}},
    }
    gpu = runtimes["h100"]["spec"]
    assert gpu["images"] == {"cpu": trainer_image(), "gpu": "registry.example/t:gpu-1"}
    fabric = gpu["pods"]["fabric"]
    # Maps merge key by key; a list replaces the chart's.
    assert fabric["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3", "pool": "h100"}
    assert fabric["env"] == [{"name": "NCCL_DEBUG", "value": "INFO"}]
    assert fabric["resources"]["limits"] == {"rdma/ib": 1}
    # The merge left the chart's own spec alone: a later render has it whole.
    assert chart_runtimes(*GPU_IB)["h100-ib"]["spec"]["pods"]["fabric"]["nodeSelector"] == {
        "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"
    }


def test_extra_runtimes_are_taken_as_they_are() -> None:
    extra = [
        {"name": "team-x", "spec": {"images": {"cpu": "registry.example/t:1"}, "overridable": ["model"]}}
    ]
    runtimes = chart_runtimes("--set-json", f"runtimes.extra={json.dumps(extra)}")
    assert sorted(runtimes) == ["cpu-dev", "team-x"]
    assert runtimes["team-x"]["spec"] == extra[0]["spec"]


def test_a_runtime_named_twice_fails_the_render() -> None:
    proc = helm_template(*GPU_IB, "--set", "runtimes.gpuIB.name=cpu-dev")
    assert proc.returncode != 0 and '"cpu-dev" is named twice' in proc.stderr, proc.stderr


def test_a_runtime_the_crd_refuses_is_caught_here() -> None:
    """The check in chart_runtimes can fail: a runtime breaking a CEL rule (a model cache per job)."""
    spec = {"storage": {"modelCache": {"mountPath": "/models", "claimTemplate": {"size": "1Ti"}}}}
    with pytest.raises(AssertionError, match="claimName"):
        chart_runtimes("--set-json", f"runtimes.cpuDev.spec={json.dumps(spec)}")


def test_the_values_schema_knows_the_runtime_fields() -> None:
    """values.schema.json lists a runtime spec's top-level fields (a typo fails at install): the CRD's."""
    from rlhf_api.crd import runtime_spec_schema

    schema = json.loads((CHART / "values.schema.json").read_text())
    assert set(schema["definitions"]["runtimeSpec"]["properties"]) == set(runtime_spec_schema()["properties"])


# ---- the Deployment ------------------------------------------------------------------------------


def test_deployment_security() -> None:
    dep = deployment()
    spec = dep["spec"]
    assert spec["replicas"] == 1
    # The new pod may start beside the old one: it waits for the Lease the old one releases.
    assert spec["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1},
    }
    pod = spec["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 10001
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    # Service links would set RLHF_OPERATOR_METRICS_PORT=tcp://... from the release's metrics Service.
    assert pod["enableServiceLinks"] is False
    sc = container(dep)["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert "privileged" not in sc or sc["privileged"] is False
    resources = container(dep)["resources"]
    assert {"cpu", "memory"} <= resources["requests"].keys() and "memory" in resources["limits"]
    # The read-only root file system needs a writable /tmp.
    mounts = {m["mountPath"]: m["name"] for m in container(dep)["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "emptyDir" in volumes[mounts["/tmp"]]
    assert pod["serviceAccountName"] == f"{RELEASE}"
    assert not pod.get("hostNetwork") and not pod.get("hostPID")


def test_probes_ports_and_arguments_agree() -> None:
    dep = deployment("--set", "operator.healthPort=9090", "--set", "operator.metricsPort=9100")
    c = container(dep)
    args = c["args"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"health": 9090, "metrics": 9100}
    liveness_url = args[args.index("--liveness") + 1]
    assert liveness_url == "http://0.0.0.0:9090/healthz"
    assert args[args.index("--metrics-port") + 1] == "9100"
    for probe in ("livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"] == {"path": "/healthz", "port": "health"}, probe
    service = one(render("--set", "operator.metricsPort=9100"), "Service")
    assert service["spec"]["ports"] == [
        {"name": "metrics", "port": 9100, "targetPort": "metrics", "protocol": "TCP"}
    ]
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert dep["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()


def test_log_format_and_verbose() -> None:
    c = container(deployment("--set", "operator.logFormat=plain", "--set", "operator.verbose=true"))
    assert {"name": "RLHF_LOG_FORMAT", "value": "plain"} in c["env"]
    assert "--verbose" in c["args"]
    assert "--verbose" not in container(deployment())["args"]


def test_trainer_image_default_follows_the_chart_version_unless_set() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())

    def trainer_image(*args: str) -> str:
        env = {e["name"]: e.get("value") for e in container(deployment(*args))["env"]}
        return str(env["RLHF_DEFAULT_TRAINER_IMAGE"])

    assert trainer_image() == f"ghcr.io/rlhf-operator/trainer:{chart['appVersion']}"
    assert trainer_image(
        "--set", "jobDefaults.trainerImage.repository=registry.example/me/trainer",
        "--set", "jobDefaults.trainerImage.tag=cpu-1",
    ) == "registry.example/me/trainer:cpu-1"  # fmt: skip


def test_image_reference() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert container(deployment())["image"].endswith(f":{chart['appVersion']}")
    assert container(deployment("--set", "image.tag=v9"))["image"].endswith(":v9")
    digest = "sha256:" + "0f" * 32
    assert container(deployment("--set", f"image.digest={digest}"))["image"].endswith(f"@{digest}")


# ---- monitoring ----------------------------------------------------------------------------------


def test_pod_monitor_selects_the_head_pods_the_operator_creates() -> None:
    """The PodMonitor's selector and port match the RayCluster that rlhf_operator.manifests builds."""
    from rlhf_api.spec import RLHFJob
    from rlhf_operator import manifests

    job = RLHFJob.model_validate(yaml.safe_load((ROOT / "examples" / "rlhfjob-llama-8b.yaml").read_text()))
    head = manifests.build_raycluster(job)["spec"]["headGroupSpec"]["template"]
    # KubeRay adds ray.io/node-type=head to the head pod; the operator adds the rest.
    head_labels = {**head["metadata"]["labels"], "ray.io/node-type": "head"}
    head_ports = {p["name"] for c in head["spec"]["containers"] for p in c.get("ports", [])}

    monitor = one(render(*monitoring_args()), "PodMonitor")
    selector = monitor["spec"]["selector"]
    assert selector["matchLabels"].items() <= head_labels.items()
    for expr in selector["matchExpressions"]:
        assert expr["operator"] == "Exists" and expr["key"] in head_labels, expr
    assert head_labels[manifests.JOB_LABEL] == job.metadata["name"]
    assert {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]} == {"rlhf-metrics"} <= head_ports
    # Worker pods carry the same job label but are not scraped.
    worker_labels = {**head_labels, "ray.io/node-type": "worker"}
    assert not selector["matchLabels"].items() <= worker_labels.items()


def test_monitors_follow_the_rbac_mode() -> None:
    cluster_wide = one(render(*monitoring_args()), "PodMonitor")
    assert cluster_wide["spec"]["namespaceSelector"] == {"any": True}
    namespaced = one(render(*WATCH_ARGS, *monitoring_args()), "PodMonitor")
    assert namespaced["spec"]["namespaceSelector"] == {"matchNames": WATCHED}
    service_monitor = one(render(*monitoring_args()), "ServiceMonitor")
    (endpoint,) = service_monitor["spec"]["endpoints"]
    assert endpoint["port"] == "metrics" and endpoint["honorLabels"] is True
    assert service_monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}


def alerts(*args: str) -> dict[str, dict[str, Any]]:
    rule = one(render(*monitoring_args(), *args), "PrometheusRule")
    return {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"]}


def test_alert_settings_come_from_values() -> None:
    default = alerts()
    assert set(default) == {
        "RLHFJobStepStalled",
        "RLHFJobPhaseStuck",
        "RLHFJobWeightSyncSlow",
        "RLHFJobRewardErrors",
        "RLHFJobFailed",
        "RLHFOperatorDown",
    }
    changed = alerts(
        "--set",
        "metrics.prometheusRule.weightSyncShareThreshold=0.35",
        "--set",
        "metrics.prometheusRule.rewardErrorsWindow=30m",
        "--set",
        "metrics.prometheusRule.alerts.RLHFJobFailed.severity=critical",
        "--set",
        "metrics.prometheusRule.alerts.RLHFJobPhaseStuck.for=7m",
        "--set",
        "metrics.prometheusRule.alerts.RLHFJobStepStalled.enabled=false",
        "--set",
        "metrics.prometheusRule.runbookBaseUrl=https://docs.example.com/rlhf/",
    )
    assert "RLHFJobStepStalled" not in changed
    assert re.search(r">\s*0\.35\s*$", changed["RLHFJobWeightSyncSlow"]["expr"].strip())
    assert "[30m]" in changed["RLHFJobRewardErrors"]["expr"]
    assert changed["RLHFJobFailed"]["labels"]["severity"] == "critical"
    assert changed["RLHFJobPhaseStuck"]["for"] == "7m"
    assert changed["RLHFJobFailed"]["annotations"]["runbook_url"] == (
        "https://docs.example.com/rlhf/monitoring.md#rlhfjobfailed"
    )


def test_operator_down_needs_the_service_monitor_and_a_replica() -> None:
    assert "RLHFOperatorDown" not in alerts("--set", "metrics.serviceMonitor.enabled=false")
    assert "RLHFOperatorDown" not in alerts("--set", "replicaCount=0")
    expr = alerts("--set", "fullnameOverride=ops")["RLHFOperatorDown"]["expr"]
    assert 'up{job="ops-metrics", namespace="rlhf-system"}' in expr


def test_no_prometheus_rule_when_every_alert_is_off() -> None:
    off = [
        a
        for name in (
            "RLHFJobStepStalled",
            "RLHFJobPhaseStuck",
            "RLHFJobWeightSyncSlow",
            "RLHFJobRewardErrors",
            "RLHFJobFailed",
            "RLHFOperatorDown",
        )
        for a in ("--set", f"metrics.prometheusRule.alerts.{name}.enabled=false")
    ]
    assert "PrometheusRule" not in kinds(render(*monitoring_args(), *off))


def contract_metrics() -> set[str]:
    """Metric names in the tables of docs/monitoring.md (the metrics contract)."""
    doc = (ROOT / "docs" / "monitoring.md").read_text()
    return set(re.findall(r"^\| `(rlhf_[a-z_]+)` \|", doc, flags=re.MULTILINE))


def exported_names(metric: str) -> set[str]:
    """Series names a metric of the contract can appear under (counters and histograms add suffixes)."""
    return {metric, f"{metric}_bucket", f"{metric}_sum", f"{metric}_count"}


def test_dashboard(tmp_path: Path) -> None:
    cm = one(render("--set", "metrics.dashboard.enabled=true"), "ConfigMap")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(cm["data"]["rlhf-training.json"])
    assert dashboard == json.loads((CHART / "dashboards" / "rlhf-training.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    used = {m for e in exprs for m in re.findall(r"\brlhf_[a-z_]+\b", e)}
    for required in (
        "rlhf_step_phase_seconds",
        "rlhf_generated_tokens_total",
        "rlhf_reward_mean",
        "rlhf_kl",
        "rlhf_rollout_engines",
        "rlhf_trainer_idle_ratio",
        "rlhf_rollout_idle_ratio",
        "rlhf_sample_staleness_sum",
    ):
        assert required in used, f"the dashboard does not show {required}"
    known = {name for m in contract_metrics() for name in exported_names(m)}
    assert used <= known, f"the dashboard uses metrics outside docs/monitoring.md: {sorted(used - known)}"
    stacked = [
        p
        for p in dashboard["panels"]
        if "rlhf_step_phase_seconds" in json.dumps(p.get("targets"))
        and p["fieldConfig"]["defaults"].get("custom", {}).get("stacking", {}).get("mode") == "normal"
    ]
    assert stacked, "no stacked panel of the step's phases"
    # Every query parses: check them with promtool as recording rules, Grafana variables filled in.
    filled = [
        e.replace("$__rate_interval", "5m").replace("$namespace", "ns").replace("$rlhfjob", "job")
        for e in exprs
    ]
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [{"record": f"dashboard:query{i}", "expr": e} for i, e in enumerate(filled)],
            }
        ]
    }
    path = tmp_path / "dashboard-queries.yaml"
    path.write_text(dump_yaml(rules))
    proc = run([tool("promtool"), "check", "rules", path])
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"


# ---- NOTES, README, CRD --------------------------------------------------------------------------


def notes(tmp_path: Path, *args: str) -> str:
    """NOTES.txt as `helm install` prints it, rendered through a probe template in a copy of the chart."""
    chart = tmp_path / "chart"
    shutil.copytree(CHART, chart)
    (chart / "templates" / "zz-notes-probe.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: notes-probe\ndata:\n  notes: |\n"
        '    {{- include "rlhf-operator/templates/NOTES.txt" . | nindent 4 }}\n'
    )
    (probe,) = [o for o in render(*args, chart=chart) if o["metadata"]["name"] == "notes-probe"]
    text: str = probe["data"]["notes"]
    return text


def test_notes(tmp_path: Path) -> None:
    cluster_wide = notes(tmp_path, "--api-versions", "ray.io/v1")
    assert f"kubectl -n {NAMESPACE} rollout status deployment/{RELEASE}" in cluster_wide
    assert "all namespaces" in cluster_wide
    assert "WARNING" not in cluster_wide
    shutil.rmtree(tmp_path / "chart")
    namespaced = notes(tmp_path, *WATCH_ARGS, "--set", "metrics.prometheusRule.enabled=true")
    assert "team-a, team-b" in namespaced
    assert "does not serve ray.io/v1" in namespaced
    assert "does not serve\nmonitoring.coreos.com/v1" in namespaced
    assert "RLHFOperatorDown is left out" in namespaced


def test_chart_crd_is_the_generated_one() -> None:
    """crds/ holds exactly the CRDs generated from the models (Helm installs what is there)."""
    from rlhf_api.crd import all_crds

    generated = all_crds()
    assert sorted(p.name for p in (CHART / "crds").iterdir()) == sorted(generated)
    for name, text in generated.items():
        assert (CHART / "crds" / name).read_text() == text, (
            f"charts/rlhf-operator/crds/{name} drifted from the model: run `make crd`"
        )
    # What `helm install` sends: the same objects, through Helm's own reading of crds/.
    proc = helm_template("--include-crds")
    assert proc.returncode == 0, proc.stderr
    crds = [d for d in yaml.safe_load_all(proc.stdout) if d and d["kind"] == "CustomResourceDefinition"]
    by_name = {d["metadata"]["name"]: d for d in crds}
    assert len(by_name) == len(crds)
    assert by_name == {name.removesuffix(".yaml"): yaml.safe_load(text) for name, text in generated.items()}


def test_readme_is_up_to_date() -> None:
    proc = subprocess.run(
        [sys.executable, str(CHART / "gen_readme.py"), "--check"], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr


def test_every_value_is_documented_and_in_the_schema() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    schema = json.loads((CHART / "values.schema.json").read_text())

    def walk(v: dict[str, Any], s: dict[str, Any], path: str) -> None:
        if "$ref" in s:
            s = schema["definitions"][s["$ref"].rsplit("/", 1)[1]]
        if s.get("additionalProperties") is False:
            for key, sub in v.items():
                assert key in s["properties"], f"{path}{key} is not in values.schema.json"
                if isinstance(sub, dict) and sub:
                    walk(sub, s["properties"][key], f"{path}{key}.")

    walk(values, schema, "")
    readme = (CHART / "README.md").read_text()
    for key in values:
        assert f"`{key}" in readme, f"README.md does not document {key}"


def test_replicas_elect_a_leader_on_a_lease_and_two_get_a_disruption_budget() -> None:
    objects = render()
    args = container(one(objects, "Deployment"))["args"]
    assert "--leader-elect" in args
    env = {e["name"]: e for e in container(one(objects, "Deployment"))["env"]}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    [role] = [r for r in by_kind(objects, "Role") if r["metadata"]["name"].endswith("-leader-election")]
    assert role["metadata"]["namespace"] == NAMESPACE
    assert role["rules"] == [
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
        {
            "apiGroups": ["coordination.k8s.io"],
            "resources": ["leases"],
            "resourceNames": ["rlhf-operator-leader"],
            "verbs": ["get", "update"],
        },
    ]
    [binding] = [
        b for b in by_kind(objects, "RoleBinding") if b["metadata"]["name"] == role["metadata"]["name"]
    ]
    assert binding["subjects"][0]["name"] == one(objects, "ServiceAccount")["metadata"]["name"]
    assert not by_kind(objects, "PodDisruptionBudget")
    two = render("--set", "replicaCount=2")
    assert one(two, "Deployment")["spec"]["replicas"] == 2
    pdb = one(two, "PodDisruptionBudget")
    assert pdb["spec"]["minAvailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"] == one(two, "Deployment")["spec"]["selector"]["matchLabels"]


VAP_API = ["--api-versions", "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy"]


def test_the_admission_policies_are_the_generated_ones_under_the_releases_name() -> None:
    """templates/runtime-admission.yaml renders rlhf_api.admission's policies, named per release and
    labelled; none without the API (below 1.30) or with runtimes.admissionPolicy off."""
    from rlhf_api import admission, crd
    from rlhf_api.runtime_spec import CLUSTER_KIND, NAMESPACED_KIND

    objects = render(*VAP_API)
    policies = by_kind(objects, "ValidatingAdmissionPolicy")
    bindings = by_kind(objects, "ValidatingAdmissionPolicyBinding")
    assert len(policies) == len(bindings) == 2
    prefix = policies[0]["metadata"]["name"].rsplit("-", 1)[0]
    assert prefix == f"{NAMESPACE}-{RELEASE}", prefix
    for kind in (CLUSTER_KIND, NAMESPACED_KIND):
        want_policy, want_binding = admission.policy(kind, crd.spec_schema(), prefix)
        [got] = [p for p in policies if p["metadata"]["name"] == want_policy["metadata"]["name"]]
        assert got["spec"] == want_policy["spec"]
        [bound] = [b for b in bindings if b["metadata"]["name"] == want_binding["metadata"]["name"]]
        assert bound["spec"] == want_binding["spec"]
    for obj in policies + bindings:
        assert obj["metadata"]["labels"]["app.kubernetes.io/instance"] == RELEASE
    assert not by_kind(
        render(*VAP_API, "--set", "runtimes.admissionPolicy=false"), "ValidatingAdmissionPolicy"
    )
    assert not by_kind(render(), "ValidatingAdmissionPolicy")
