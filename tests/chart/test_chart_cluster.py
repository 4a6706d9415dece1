"""The Helm chart on the local control plane: install, upgrade, uninstall, and what its RBAC allows.

Permissions are checked with `kubectl auth can-i --as=system:serviceaccount:...` (a
SubjectAccessReview), so the real API server's RBAC evaluates the chart's roles and bindings.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from chart_tools import CHART
from support import Cluster, wait_for

pytestmark = pytest.mark.cluster

RELEASE = "rlhf-operator"  # contains the chart name, so the objects are named "rlhf-operator"


def can_i(cluster: Cluster, namespace: str, verb: str, resource: str, *where: str, sa: str = RELEASE) -> bool:
    """Whether the ServiceAccount may `verb resource` (where: `-n NS`, `-A`, `--subresource=...`)."""
    proc = cluster.kubectl(
        "auth", "can-i", verb, resource, *where, f"--as=system:serviceaccount:{namespace}:{sa}", check=False
    )
    answer = proc.stdout.strip()
    assert answer in {"yes", "no"}, (
        f"kubectl auth can-i {verb} {resource} {where}: {proc.stdout}{proc.stderr}"
    )
    return answer == "yes"


@contextmanager
def extra_namespace(cluster: Cluster, prefix: str) -> Iterator[str]:
    name = f"{prefix}-{uuid.uuid4().hex[:5]}"
    cluster.kubectl("create", "namespace", name)
    try:
        yield name
    finally:
        cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


@contextmanager
def released(cluster: Cluster, namespace: str) -> Iterator[None]:
    """Uninstalls the release afterwards even if the test failed (its cluster-scoped objects outlive namespaces)."""
    try:
        yield
    finally:
        cluster.helm("uninstall", RELEASE, "-n", namespace, "--wait", check=False)


def install(cluster: Cluster, namespace: str, *values: str) -> str:
    proc = cluster.helm(
        "install", RELEASE, str(CHART), "-n", namespace, "--wait", "--timeout", "120s", *values
    )
    cluster.kubectl("-n", namespace, "rollout", "status", f"deployment/{RELEASE}", "--timeout=60s")
    return proc.stdout


def operator_args(cluster: Cluster, namespace: str) -> list[str]:
    dep = cluster.get("deployment", RELEASE, namespace)
    assert dep is not None
    args: list[str] = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    return args


def test_install_upgrade_uninstall(cluster: Cluster, namespace: str) -> None:
    cluster_role = f"{namespace}-{RELEASE}"
    with released(cluster, namespace), extra_namespace(cluster, "watched") as watched:
        # Cluster-wide, with monitoring switched on: this cluster has no Prometheus Operator, so the
        # chart leaves the monitors and rules out and says so in its notes.
        out = install(
            cluster,
            namespace,
            "--set",
            "metrics.serviceMonitor.enabled=true",
            "--set",
            "metrics.prometheusRule.enabled=true",
        )
        assert "does not serve\nmonitoring.coreos.com/v1" in out, out
        assert cluster.get("crd", "rlhfjobs.rlhf.dev") is not None
        assert cluster.get("clusterrole", cluster_role) is not None
        assert "--all-namespaces" in operator_args(cluster, namespace)
        for ns in (namespace, watched, "default"):
            assert can_i(cluster, namespace, "list", "rlhfjobs.rlhf.dev", "-n", ns)
            assert can_i(cluster, namespace, "patch", "rlhfjobs.rlhf.dev", "--subresource=status", "-n", ns)
            assert can_i(cluster, namespace, "create", "rayclusters.ray.io", "-n", ns)
            assert can_i(cluster, namespace, "create", "events", "-n", ns)
            assert not can_i(cluster, namespace, "get", "secrets", "-n", ns)
            assert not can_i(cluster, namespace, "create", "pods", "-n", ns)
            assert not can_i(cluster, namespace, "create", "rlhfjobs.rlhf.dev", "-n", ns)
        assert can_i(cluster, namespace, "list", "rlhfjobs.rlhf.dev", "-A")
        assert not can_i(cluster, namespace, "list", "secrets", "-A")
        assert can_i(cluster, namespace, "watch", "customresourcedefinitions.apiextensions.k8s.io")
        assert not can_i(cluster, namespace, "create", "customresourcedefinitions.apiextensions.k8s.io")
        assert not can_i(cluster, namespace, "list", "namespaces")
        assert not can_i(cluster, namespace, "create", "clusterroles.rbac.authorization.k8s.io")

        # Upgrade to watch one namespace: the cluster-wide grant goes, a Role in that namespace comes.
        cluster.helm(
            "upgrade",
            RELEASE,
            str(CHART),
            "-n",
            namespace,
            "--wait",
            "--timeout",
            "120s",
            "--set-json",
            f"watchNamespaces={json.dumps([watched])}",
        )
        assert cluster.get("clusterrole", cluster_role) is None
        assert cluster.get("role", RELEASE, watched) is not None
        assert cluster.get("clusterrole", f"{cluster_role}-crds") is not None
        args = operator_args(cluster, namespace)
        assert "--all-namespaces" not in args and args[args.index("--namespace") + 1] == watched
        assert can_i(cluster, namespace, "list", "rlhfjobs.rlhf.dev", "-n", watched)
        assert not can_i(cluster, namespace, "list", "rlhfjobs.rlhf.dev", "-n", namespace)
        assert not can_i(cluster, namespace, "list", "rlhfjobs.rlhf.dev", "-A")

        cluster.helm("uninstall", RELEASE, "-n", namespace, "--wait")
        leftovers: list[tuple[str, str, str | None]] = [
            ("deployment", RELEASE, namespace),
            ("serviceaccount", RELEASE, namespace),
            ("role", RELEASE, watched),
            ("clusterrole", f"{cluster_role}-crds", None),
            ("clusterrole", f"{cluster_role}-edit", None),
        ]
        for kind, name, obj_ns in leftovers:
            assert cluster.get(kind, name, obj_ns) is None, f"{kind} {name} left after uninstall"
        assert not can_i(cluster, namespace, "list", "rlhfjobs.rlhf.dev", "-n", watched)
        # Helm never deletes CRDs from crds/ (that would delete every RLHFJob).
        assert cluster.get("crd", "rlhfjobs.rlhf.dev") is not None


def test_watch_namespaces_mode_denies_other_namespaces(cluster: Cluster, namespace: str) -> None:
    with released(cluster, namespace), extra_namespace(cluster, "other") as other:
        install(cluster, namespace, "--set-json", f"watchNamespaces={json.dumps([namespace])}")
        assert can_i(cluster, namespace, "watch", "rlhfjobs.rlhf.dev", "-n", namespace)
        assert can_i(cluster, namespace, "delete", "rayclusters.ray.io", "-n", namespace)
        assert can_i(cluster, namespace, "get", "services", "-n", namespace)
        for ns in (other, "default", "kube-system"):
            assert not can_i(cluster, namespace, "list", "rlhfjobs.rlhf.dev", "-n", ns), ns
            assert not can_i(cluster, namespace, "create", "rayclusters.ray.io", "-n", ns), ns
            assert not can_i(cluster, namespace, "list", "pods", "-n", ns), ns
        assert not can_i(cluster, namespace, "list", "rlhfjobs.rlhf.dev", "-A")
        assert not can_i(cluster, namespace, "get", "secrets", "-n", namespace)
        assert not can_i(cluster, namespace, "list", "namespaces")
        assert can_i(cluster, namespace, "list", "customresourcedefinitions.apiextensions.k8s.io")


def test_namespace_editors_can_manage_rlhfjobs(cluster: Cluster, namespace: str) -> None:
    """The chart's user roles aggregate into the built-in `edit` and `view` ClusterRoles."""
    with released(cluster, namespace):
        install(cluster, namespace)
        cluster.kubectl("-n", namespace, "create", "serviceaccount", "alice")
        cluster.kubectl("-n", namespace, "create", "serviceaccount", "bob")
        cluster.kubectl(
            "-n",
            namespace,
            "create",
            "rolebinding",
            "alice-edit",
            "--clusterrole=edit",
            f"--serviceaccount={namespace}:alice",
        )
        cluster.kubectl(
            "-n",
            namespace,
            "create",
            "rolebinding",
            "bob-view",
            "--clusterrole=view",
            f"--serviceaccount={namespace}:bob",
        )
        # The controller-manager's aggregation controller copies the rules in shortly after install.
        wait_for(
            lambda: can_i(cluster, namespace, "create", "rlhfjobs.rlhf.dev", "-n", namespace, sa="alice"),
            60,
            "`edit` to include RLHFJobs",
        )
        assert can_i(
            cluster,
            namespace,
            "patch",
            "rlhfjobs.rlhf.dev",
            "--subresource=scale",
            "-n",
            namespace,
            sa="alice",
        )
        wait_for(
            lambda: can_i(cluster, namespace, "list", "rlhfjobs.rlhf.dev", "-n", namespace, sa="bob"),
            60,
            "`view` to include RLHFJobs",
        )
        assert not can_i(cluster, namespace, "create", "rlhfjobs.rlhf.dev", "-n", namespace, sa="bob")
        assert not can_i(cluster, namespace, "list", "rlhfjobs.rlhf.dev", "-n", "default", sa="alice")


def test_bad_values_are_rejected_before_anything_is_created(cluster: Cluster, namespace: str) -> None:
    proc = cluster.helm(
        "install",
        RELEASE,
        str(CHART),
        "-n",
        namespace,
        "--set-json",
        'watchNamespaces=["Not_A_Namespace"]',
        check=False,
    )
    assert proc.returncode != 0
    assert "/watchNamespaces/0" in proc.stderr, proc.stderr
    assert cluster.get("deployment", RELEASE, namespace) is None
    assert cluster.helm("list", "-n", namespace, "-q").stdout.strip() == ""
