"""The Helm chart on the local control plane: install, upgrade, uninstall, and what its RBAC allows.

Permissions are checked two ways: with `kubectl auth can-i --as=system:serviceaccount:...` (a
SubjectAccessReview, so the real API server's RBAC evaluates the chart's roles and bindings), and
by running the real operator with a token of the chart's ServiceAccount, as its pod would.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import tempfile
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml
from testkit.chart_tools import CHART, ROOT, monitoring_args, one, render
from testkit.support import VENV_BIN, Cluster, free_port, wait_for

pytestmark = pytest.mark.cluster

RELEASE = "rlhf-operator"  # contains the chart name, so the objects are named "rlhf-operator"


def can_i(cluster: Cluster, namespace: str, verb: str, resource: str, *where: str, sa: str = RELEASE) -> bool:
    """Whether the ServiceAccount may `verb resource` (where: `-n NS`, `-A`, `--subresource=...`)."""
    proc = cluster.kubectl(
        "auth", "can-i", verb, resource, *where, f"--as=system:serviceaccount:{namespace}:{sa}", check=False
    )
    answer = str(proc.stdout).strip()
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
    return str(proc.stdout)


def ready_endpoints(cluster: Cluster, namespace: str, service: str) -> list[tuple[str, int]]:
    """(port name, port) of the Service's ready endpoints, from its EndpointSlices."""
    found = []
    for eps in cluster.list("endpointslices", namespace, selector=f"kubernetes.io/service-name={service}"):
        addresses = [e for e in eps.get("endpoints") or [] if e.get("conditions", {}).get("ready")]
        found += [(p["name"], p["port"]) for p in eps.get("ports") or [] for _ in addresses]
    return found


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
        # The metrics Service (what the ServiceMonitor scrapes) selects the operator pod's `metrics` port.
        ready = wait_for(
            lambda: ready_endpoints(cluster, namespace, f"{RELEASE}-metrics"),
            60,
            "the metrics Service's endpoints",
        )
        assert ready == [("metrics", 8000)], ready
        assert cluster.get("crd", "rlhfjobs.rlhf.dev") is not None
        assert cluster.get("clusterrlhfruntime", "cpu-dev") is not None  # the API server took the chart's
        assert cluster.get("clusterrole", cluster_role) is not None
        assert "--all-namespaces" in operator_args(cluster, namespace)
        for ns in (namespace, watched, "default"):
            assert can_i(cluster, namespace, "list", "rlhfjobs.rlhf.dev", "-n", ns)
            assert can_i(cluster, namespace, "patch", "rlhfjobs.rlhf.dev", "--subresource=status", "-n", ns)
            assert can_i(cluster, namespace, "create", "rayclusters.ray.io", "-n", ns)
            assert can_i(cluster, namespace, "create", "events", "-n", ns)
            assert not can_i(cluster, namespace, "get", "secrets", "-n", ns)
            assert not can_i(cluster, namespace, "list", "secrets", "-n", ns)
            assert can_i(cluster, namespace, "create", "secrets", "-n", ns)  # each job's Ray token
            assert can_i(cluster, namespace, "create", "networkpolicies.networking.k8s.io", "-n", ns)
            assert not can_i(cluster, namespace, "create", "pods", "-n", ns)
            assert not can_i(cluster, namespace, "create", "rlhfjobs.rlhf.dev", "-n", ns)
            assert can_i(cluster, namespace, "get", "rlhfruntimes.rlhf.dev", "-n", ns)
            assert not can_i(cluster, namespace, "list", "configmaps", "-n", ns)
        assert can_i(cluster, namespace, "get", "clusterrlhfruntimes.rlhf.dev")
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
        assert cluster.get("clusterrole", f"{cluster_role}-discovery") is not None
        args = operator_args(cluster, namespace)
        assert "--all-namespaces" not in args and args[args.index("--namespace") + 1] == watched
        assert can_i(cluster, namespace, "list", "rlhfjobs.rlhf.dev", "-n", watched)
        assert not can_i(cluster, namespace, "list", "rlhfjobs.rlhf.dev", "-n", namespace)
        assert not can_i(cluster, namespace, "list", "rlhfjobs.rlhf.dev", "-A")
        assert can_i(cluster, namespace, "get", "clusterrlhfruntimes.rlhf.dev")  # cluster-scoped, both modes

        cluster.helm("uninstall", RELEASE, "-n", namespace, "--wait")
        leftovers: list[tuple[str, str, str | None]] = [
            ("deployment", RELEASE, namespace),
            ("serviceaccount", RELEASE, namespace),
            ("role", RELEASE, watched),
            ("clusterrole", f"{cluster_role}-discovery", None),
            ("clusterrole", f"{cluster_role}-edit", None),
            ("clusterrlhfruntime", "cpu-dev", None),
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
        # kopf with a namespace list follows the namespaces themselves (names and labels), nothing in them.
        assert can_i(cluster, namespace, "watch", "namespaces")
        assert not can_i(cluster, namespace, "create", "namespaces")
        assert not can_i(cluster, namespace, "get", f"namespaces/{other}")
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


# ---- the operator itself, with the ServiceAccount's token ---------------------------------------------

PERMISSION_ERRORS = ("forbidden", " 403", "(403)", "not enough permissions")


def token_kubeconfig(cluster: Cluster, namespace: str, sa: str, path: Path) -> Path:
    """A kubeconfig that authenticates with a fresh token of ServiceAccount `namespace/sa` (TokenRequest)."""
    token = cluster.kubectl("-n", namespace, "create", "token", sa, "--duration=30m").stdout.strip()
    admin = yaml.safe_load(cluster.kubeconfig.read_text())
    (server,) = admin["clusters"]
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [server],
                "users": [{"name": sa, "user": {"token": token}}],
                "contexts": [{"name": sa, "context": {"cluster": server["name"], "user": sa}}],
                "current-context": sa,
            }
        )
    )
    return path


def container_command(cluster: Cluster, namespace: str) -> tuple[list[str], dict[str, str]]:
    """The arguments and environment variables of the chart's operator container, as installed."""
    dep = cluster.get("deployment", RELEASE, namespace)
    assert dep is not None
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
    # The downward API, as the kubelet resolves it: the leader election's identity and Lease namespace.
    fields = {"metadata.name": f"{RELEASE}-test-pod", "metadata.namespace": namespace}
    for e in container.get("env", []):
        ref = (e.get("valueFrom") or {}).get("fieldRef", {}).get("fieldPath")
        if ref:
            env[e["name"]] = fields[ref]
    # The Ray token key's Secret volume, as the kubelet mounts it: the file the env names, in a temp dir.
    volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    secret = cluster.get("secret", volumes["ray-token-key"]["secret"]["secretName"], namespace)
    assert secret is not None, "the chart's Ray token key Secret"
    key_file = Path(tempfile.mkdtemp(prefix="rlhf-key-")) / "key"
    key_file.write_bytes(base64.b64decode(secret["data"]["key"]))
    env["RLHF_RAY_TOKEN_KEY_FILE"] = str(key_file)
    return list(container["args"]), env


@contextmanager
def operator_process(
    chart_args: list[str], chart_env: dict[str, str], kubeconfig: Path, log: Path, health_port: int
) -> Iterator[subprocess.Popen[bytes]]:
    """`rlhf operator` (the image's ENTRYPOINT) with the installed Deployment's arguments and
    environment, authenticated by `kubeconfig`. Only the ports change, to free local ones: the
    liveness endpoint moves to 127.0.0.1:`health_port`, and the metrics endpoint is switched off.

    No development override of the Ray head: the operator reaches for the head Service's DNS name,
    which does not resolve here, so it never submits anything to a local Ray.
    """
    args = list(chart_args)
    args[args.index("--liveness") + 1] = f"http://127.0.0.1:{health_port}/healthz"
    args[args.index("--metrics-port") + 1] = "0"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLHF_")}
    env.update({**chart_env, "KUBECONFIG": str(kubeconfig), "RLHF_RECONCILE_INTERVAL": "1"})
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [str(VENV_BIN / "rlhf"), "operator", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def permission_errors(log: Path) -> list[str]:
    return [
        line
        for line in log.read_text(errors="replace").splitlines()
        if any(e in line.lower() for e in PERMISSION_ERRORS)
    ]


def audit_log(cluster: Cluster) -> Path:
    audit = Path(cluster.kubeconfig).parent / "logs" / "audit.log"
    assert audit.is_file(), f"no audit log at {audit} (devcluster/devcluster.py configures it)"
    return audit


def _audited_events_of_user(cluster: Cluster, username: str, since: int) -> list[dict[str, Any]]:
    """The API server's audit events of one user from byte `since` of its log (the policy records writes)."""
    audit = audit_log(cluster)
    with audit.open("rb") as f:
        f.seek(since if audit.stat().st_size >= since else 0)  # from the start again after a rotation
        lines = f.read().decode(errors="replace").splitlines()
    events = []
    for line in lines:
        if username in line:
            event = json.loads(line)
            if event.get("user", {}).get("username") == username:
                events.append(event)
    return events


def test_the_operator_runs_with_its_service_account(cluster: Cluster, namespace: str, tmp_path: Path) -> None:
    """The real operator, holding only the chart's ServiceAccount token, reconciles an RLHFJob in its
    watched namespace: it sees the job, creates and owns the RayCluster, writes status and Events, and
    no request it makes is refused. The same operator with a ServiceAccount the chart did not bind is
    refused, so the check can fail.

    Watch-namespaces mode only: a cluster-wide operator here would also reconcile the RLHFJobs of
    other tests. The cluster-wide ClusterRole holds the same job rules (test_chart.py checks that)."""
    from rlhf_operator import manifests

    username = f"system:serviceaccount:{namespace}:{RELEASE}"
    audit_start = audit_log(cluster).stat().st_size
    with released(cluster, namespace), extra_namespace(cluster, "jobs") as jobs:
        install(
            cluster,
            namespace,
            "--set-json",
            f"watchNamespaces={json.dumps([jobs])}",
            "--set",
            "operator.verbose=true",
        )
        chart_args, chart_env = container_command(cluster, namespace)
        assert chart_args[-2:] == ["--namespace", jobs], chart_args
        wait_for(
            lambda: cluster.get("serviceaccount", "default", jobs),
            30,
            f"the default ServiceAccount in {jobs}",
        )

        # Negative control: the watched namespace's `default` ServiceAccount has no grant.
        port = free_port()
        denied_log = tmp_path / "denied.log"
        denied = token_kubeconfig(cluster, jobs, "default", tmp_path / "denied.kubeconfig")
        with operator_process(chart_args, chart_env, denied, denied_log, port):
            wait_for(lambda: permission_errors(denied_log), 60, "the unbound ServiceAccount to be refused")

        # Suspended (runPolicy.suspend): the operator still creates the RayCluster, suspends it and
        # reports the phase, but no operator (nor one of another test's running concurrently with the
        # development head override) submits a trainer for it.
        job = yaml.safe_load((ROOT / "examples" / "rlhfjob-tiny.yaml").read_text())
        job["metadata"] = {"name": "rbac-probe", "namespace": jobs}
        job["spec"].setdefault("runPolicy", {})["suspend"] = True
        cluster_name = manifests.raycluster_name("rbac-probe")

        port = free_port()
        log = tmp_path / "operator.log"
        granted = token_kubeconfig(cluster, namespace, RELEASE, tmp_path / "sa.kubeconfig")
        with operator_process(chart_args, chart_env, granted, log, port) as proc:
            wait_for(lambda: healthy(port), 60, "the operator's /healthz (the chart's probes)")
            cluster.apply(job, jobs)
            created = wait_for(lambda: cluster.get("raycluster", cluster_name, jobs), 60, "the RayCluster")
            uid = cluster.get("rlhfjob", "rbac-probe", jobs)["metadata"]["uid"]  # type: ignore[index]
            assert [o["uid"] for o in created["metadata"].get("ownerReferences", [])] == [uid]
            wait_for(
                lambda: (
                    (cluster.get("rlhfjob", "rbac-probe", jobs) or {}).get("status", {}).get("phase")
                    == "Suspended"
                ),
                60,
                "the job's status.phase to be Suspended",
            )
            wait_for(
                lambda: (cluster.get("raycluster", cluster_name, jobs) or {}).get("spec", {}).get("suspend"),
                60,
                "the RayCluster to be suspended",
            )
            events = wait_for(
                lambda: [
                    e
                    for e in cluster.list("events", jobs)
                    if e["involvedObject"].get("name") == "rbac-probe"
                    and e.get("reason") == "RayClusterCreated"
                ],
                60,
                "the RayClusterCreated Event",
            )
            assert events
            wait_for(
                lambda: _audited_events_of_user(cluster, username, audit_start),
                60,
                f"audited writes by {username}",
            )
            assert proc.poll() is None, f"the operator exited:\n{log.read_text()[-3000:]}"
            assert healthy(port)
            # Its own periodic reconcile of the job ran to the end (read the RayCluster, wrote status).
            assert "Timer 'reconcile' succeeded" in log.read_text(), log.read_text()[-3000:]

        # Every write of the operator's ServiceAccount, as the API server recorded it.
        writes = _audited_events_of_user(cluster, username, audit_start)
        refused = [
            f"{e['verb']} {e['objectRef'].get('resource')}/{e['objectRef'].get('subresource', '')}"
            for e in writes
            if e.get("responseStatus", {}).get("code") == 403
        ]
        assert not refused, f"the API server refused the operator: {refused}"
        done = {
            (e["verb"], e["objectRef"].get("resource"), e["objectRef"].get("subresource")) for e in writes
        }
        # Alone on the job, this operator makes all of these; another test's operator running at the
        # same time may make some of them first.
        assert done & {
            ("create", "rayclusters", None),
            ("patch", "rayclusters", None),
            ("patch", "rlhfjobs", "status"),
            ("create", "events", None),
        }, done
        # Outside the watched namespace it writes only its leader-election Lease, in the release's.
        outside = {
            (e["objectRef"].get("namespace"), e["objectRef"].get("resource"), e["objectRef"].get("name"))
            for e in writes
            if e["objectRef"].get("namespace") != jobs
        }
        assert outside == {(namespace, "leases", "rlhf-operator-leader")}, (
            f"the operator wrote outside its namespace other than its Lease: {outside}"
        )
        assert not permission_errors(log), "\n".join(permission_errors(log))


def test_pod_monitor_selects_the_head_pod_kuberay_creates(cluster: Cluster, namespace: str) -> None:
    """The chart's PodMonitor selector, applied to the pods KubeRay really creates for an RLHFJob's
    RayCluster (built by the operator's own manifests code), selects the head pod only, and that pod
    has the `rlhf-metrics` port the PodMonitor scrapes."""
    from rlhf_api.spec import RLHFJob
    from rlhf_operator import manifests

    job_manifest = yaml.safe_load((ROOT / "examples" / "rlhfjob-tiny.yaml").read_text())
    # A stored job's uid: the pods reference the job's token Secret by a name that carries it.
    job_manifest["metadata"] = {"name": "scrape-probe", "namespace": namespace, "uid": "5c09e0be-probe"}
    raycluster = manifests.build_raycluster(RLHFJob.model_validate(job_manifest))
    cluster.apply(raycluster, namespace)

    def head_and_workers() -> list[dict[str, Any]] | None:
        pods = cluster.list("pods", namespace, selector=f"{manifests.JOB_LABEL}=scrape-probe")
        kinds = {p["metadata"]["labels"].get("ray.io/node-type") for p in pods}
        return pods if {"head", "worker"} <= kinds else None

    all_pods = wait_for(head_and_workers, 60, "KubeRay to create the head and worker pods")

    monitor = one(render(*monitoring_args()), "PodMonitor")
    selector = monitor["spec"]["selector"]
    terms = [f"{k}={v}" for k, v in selector.get("matchLabels", {}).items()]
    for expr in selector.get("matchExpressions", []):
        assert expr["operator"] == "Exists", expr
        terms.append(expr["key"])
    selected = cluster.list("pods", namespace, selector=",".join(terms))
    assert [p["metadata"]["labels"].get("ray.io/node-type") for p in selected] == ["head"], (
        f"selected {[p['metadata']['name'] for p in selected]} of {[p['metadata']['name'] for p in all_pods]}"
    )
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    ports = {p["name"] for c in selected[0]["spec"]["containers"] for p in c.get("ports", [])}
    assert endpoint["port"] in ports, ports
    cluster.kubectl("-n", namespace, "delete", "raycluster", raycluster["metadata"]["name"], "--wait=false")
