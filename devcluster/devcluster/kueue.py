"""Kueue in a running control plane (`kueue-up`, `kueue-down`): its CRDs and webhook manifests from
the Go module cache at the pinned version, its webhook on loopback with a certificate from the
cluster's CA, called by URL. Not part of `up`.
"""

from __future__ import annotations

import base64
import json
import re
import shutil
import time
from pathlib import Path

from devcluster.binaries import KUEUE_MODULE, OPTIONAL_COMPONENTS, go_mod_version
from devcluster.config import HOST, STATE, ClusterError
from devcluster.gobuild import build, built_binary
from devcluster.kube import kubectl, module_dir
from devcluster.pki import openssl
from devcluster.ports import Ports, check_port_free
from devcluster.processes import Component, log_tail, pid_alive, probe, start, stop, wait_healthy
from devcluster.state import cluster_ports, read_state, running_status, save_state

# Kueue (issue 16) is not part of `up`: `kueue-up` starts it against a running control plane, with its
# CRDs and webhook manifests read from the Go module cache at the pinned version, its webhook served on
# loopback with a certificate from the cluster's CA, and the API server calling it by URL (no Service).

KUEUE_NAMESPACE = "kueue-system"
# The jobs Kueue manages here, as its Configuration names them ("<group>/<kind>"); only labelled ones
# (kueue.x-k8s.io/queue-name), since manageJobsWithoutQueueName is false.
KUEUE_FRAMEWORKS = ("ray.io/raycluster", "ray.io/rayjob", "batch/job")
KUEUE_FEATURE_GATES = {
    # Alpha (off by default): a RayCluster annotated kueue.x-k8s.io/elastic-job: "true" may change its
    # worker replicas while admitted (a new Workload slice replaces the old one) and may use the autoscaler.
    "ElasticJobsViaWorkloadSlices": True,
    # The visibility API server (beta, on by default) would bind 0.0.0.0:8082 and read its certificate
    # from /visibility; nothing here uses it.
    "VisibilityOnDemand": False,
}
# The configurations' names as Kueue's release manifests have them (its kustomization's namePrefix).
KUEUE_WEBHOOK_CONFIGS = {
    "MutatingWebhookConfiguration": "kueue-mutating-webhook-configuration",
    "ValidatingWebhookConfiguration": "kueue-validating-webhook-configuration",
}
# Without internal certificate management Kueue reads its metrics serving certificate from this fixed
# path (cmd/kueue/main.go), and exits at start-up when it is missing: no flag or field moves it.
KUEUE_METRICS_CERT_DIR = Path("/etc/kueue/metrics/certs")


def kueue_module_dir() -> Path:
    return module_dir("kueue", KUEUE_MODULE)


def _kueue_component(binary: Path, config: Path, ports: Ports) -> Component:
    return Component(
        "kueue",
        [str(binary), f"--config={config}", f"--kubeconfig={STATE / 'kubeconfig'}"],
        [ports.kueue_webhook, ports.kueue_health, ports.kueue_metrics],
        # Ready once its webhook server listens (cmd/kueue/main.go's readyz check).
        f"http://{HOST}:{ports.kueue_health}/readyz",
    )


def _kueue_pki(kdir: Path) -> str:
    """The webhook's serving certificate (tls.crt/tls.key, as controller-runtime reads them from certDir),
    signed by the cluster's CA for 127.0.0.1 and localhost; returns the CA bundle (base64) the API server
    is to trust."""
    pki = STATE / "pki"
    certs = kdir / "certs"
    certs.mkdir(parents=True, exist_ok=True)
    (certs / "server.ext").write_text(
        f"subjectAltName=IP:{HOST},DNS:localhost,DNS:kueue-webhook-service.{KUEUE_NAMESPACE}.svc\n"
        "extendedKeyUsage=serverAuth\n"
    )
    openssl(
        "req", "-newkey", "rsa:2048", "-nodes", "-keyout", "tls.key", "-out", "tls.csr",
        "-subj", "/CN=kueue-webhook", cwd=certs,
    )  # fmt: skip
    openssl(
        "x509", "-req", "-in", "tls.csr", "-CA", str(pki / "ca.crt"), "-CAkey", str(pki / "ca.key"),
        "-CAcreateserial", "-CAserial", str(certs / "ca.srl"), "-out", "tls.crt", "-days", "3650",
        "-extfile", "server.ext", cwd=certs,
    )  # fmt: skip
    _kueue_metrics_certs(certs)
    return base64.b64encode((pki / "ca.crt").read_bytes()).decode()


def _kueue_metrics_certs(certs: Path) -> None:
    """Kueue's fixed metrics certificate path gets a certificate if it has none (any valid pair serves:
    its metrics endpoint authenticates callers by token, not by this certificate)."""
    target = KUEUE_METRICS_CERT_DIR
    if (target / "tls.crt").is_file() and (target / "tls.key").is_file():
        return
    try:
        target.mkdir(parents=True, exist_ok=True)
        for name in ("tls.crt", "tls.key"):
            shutil.copyfile(certs / name, target / name)
        (target / "tls.key").chmod(0o600)
    except OSError as e:
        raise ClusterError(
            f"Kueue reads its metrics certificate from {target} (a fixed path when it does not manage "
            f"certificates itself) and cannot start without one; writing it failed ({e}). Run kueue-up "
            f"as root once, or copy {certs}/tls.crt and tls.key there."
        ) from None


def _manifests_json(path: Path) -> list[dict[str, object]]:
    """A YAML manifest file as JSON objects, converted by kubectl (the standard library reads no YAML)."""
    text = kubectl("create", "--dry-run=client", "--validate=false", "-o", "json", "-f", str(path)).stdout
    decoder, objs, pos = json.JSONDecoder(), [], 0
    while text[pos:].strip():  # one JSON document per object, one after the other
        obj, end = decoder.raw_decode(text[pos:].lstrip())
        pos = len(text) - len(text[pos:].lstrip()) + end
        objs.append(obj)
    return [o for o in objs if isinstance(o, dict)]


def _install_kueue_crds(mod: Path, ca_bundle: str, ports: Ports) -> None:
    """Kueue's CRDs, server-side applied (they are too large for a client-side apply's annotation); the
    five that Kueue's kustomization converts between v1beta1 and v1beta2 get its /convert webhook."""
    crd_dir = mod / "config" / "components" / "crd"
    files = sorted((crd_dir / "bases").glob("*.yaml"))
    if not files:
        raise ClusterError(f"no Kueue CRDs found in {crd_dir / 'bases'}")
    kubectl("apply", "--server-side", "--force-conflicts", *(f"--filename={f}" for f in files))
    # The kustomization's own list: patches/ holds more webhook_in_*.yaml than it applies (ResourceFlavor's,
    # whose types have no conversion: the API server's reads of v1beta1 then fail in the webhook).
    kustomization = (crd_dir / "kustomization.yaml").read_text()
    listed = re.findall(r"^\s*-\s*path:\s*(patches/webhook_in_\S+\.yaml)\s*$", kustomization, re.MULTILINE)
    if not listed:
        raise ClusterError(f"no conversion patches listed in {crd_dir / 'kustomization.yaml'}")
    converted = []
    for patch in listed:
        for obj in _manifests_json(crd_dir / patch):
            meta = obj.get("metadata", {})
            assert isinstance(meta, dict)
            converted.append(str(meta["name"]))
    webhook = {
        "clientConfig": {"url": f"https://{HOST}:{ports.kueue_webhook}/convert", "caBundle": ca_bundle},
        "conversionReviewVersions": ["v1"],
    }
    names = [f"{f.name.split('_', 1)[1].removesuffix('.yaml')}.kueue.x-k8s.io" for f in files]
    for name in names:  # the others explicitly None: a patch of an earlier kueue-up outlives the apply
        conversion: dict[str, object] = {"strategy": "None", "webhook": None}
        if name in converted:
            conversion = {"strategy": "Webhook", "webhook": webhook}
        kubectl("patch", "crd", name, "--type=merge", "-p", json.dumps({"spec": {"conversion": conversion}}))
    names = [f"crd/{n}" for n in names]
    kubectl("wait", "--for=condition=Established", "--timeout=60s", *names)


def kueue_config(ports: Ports, cert_dir: Path) -> dict[str, object]:
    """Kueue's Configuration (config.kueue.x-k8s.io/v1beta2, the version v0.17 loads)."""
    return {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2",
        "kind": "Configuration",
        "namespace": KUEUE_NAMESPACE,
        "manageJobsWithoutQueueName": False,
        "leaderElection": {"leaderElect": False},
        "health": {"healthProbeBindAddress": f"{HOST}:{ports.kueue_health}"},  # /readyz, /healthz
        "metrics": {"bindAddress": f"{HOST}:{ports.kueue_metrics}"},
        "webhook": {"host": HOST, "port": ports.kueue_webhook, "certDir": str(cert_dir)},
        "internalCertManagement": {"enable": False},
        # waitForPodsReady: absent, so off (v1beta2 has no enable field: its presence turns it on).
        "integrations": {"frameworks": list(KUEUE_FRAMEWORKS)},
        "featureGates": KUEUE_FEATURE_GATES,
    }


def kueue_webhook_configurations(mod: Path, ports: Ports, ca_bundle: str) -> list[dict[str, object]]:
    """Kueue's two webhook configurations from its manifests.yaml, each webhook calling
    https://127.0.0.1:<port><path> instead of the in-cluster Service. Only the webhooks for Kueue's own
    kinds and for KUEUE_FRAMEWORKS are kept: the rest (pods, Deployments, StatefulSets, other operators'
    jobs) would send every such write in the cluster through Kueue for integrations that are off."""
    served = {("kueue.x-k8s.io", "*")} | {
        (group, kind + "s") for group, kind in (f.split("/", 1) for f in KUEUE_FRAMEWORKS)
    }

    def wanted(hook: dict[str, object]) -> bool:
        rules = hook.get("rules", [])
        assert isinstance(rules, list)
        pairs = [
            (g, r) for rule in rules for g in rule.get("apiGroups", []) for r in rule.get("resources", [])
        ]
        return bool(pairs) and all((g, r) in served or (g, "*") in served for g, r in pairs)

    out = []
    for obj in _manifests_json(mod / "config" / "components" / "webhook" / "manifests.yaml"):
        kind = str(obj.get("kind"))
        if kind not in KUEUE_WEBHOOK_CONFIGS:
            continue
        hooks = obj.get("webhooks", [])
        assert isinstance(hooks, list)
        kept = []
        for hook in hooks:
            if not wanted(hook):
                continue
            path = hook["clientConfig"]["service"]["path"]
            hook["clientConfig"] = {
                "url": f"https://{HOST}:{ports.kueue_webhook}{path}",
                "caBundle": ca_bundle,
            }
            kept.append(hook)
        out.append(
            {
                "apiVersion": obj["apiVersion"],
                "kind": kind,
                "metadata": {
                    "name": KUEUE_WEBHOOK_CONFIGS[kind],
                    "labels": {"app.kubernetes.io/name": "kueue"},
                },
                "webhooks": kept,
            }
        )
    return out


def _wait_kueue_admits(timeout: float = 60) -> None:
    """Kueue is ready when a ResourceFlavor passes its webhooks (a server-side dry run: nothing is kept)."""
    probe_flavor = {
        "apiVersion": "kueue.x-k8s.io/v1beta2",
        "kind": "ResourceFlavor",
        "metadata": {"name": "kueue-up-probe"},
    }
    deadline = time.monotonic() + timeout
    while True:
        proc = kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(probe_flavor), check=False)
        if proc.returncode == 0:
            return
        if time.monotonic() > deadline:
            raise ClusterError(
                f"Kueue's webhook did not admit a ResourceFlavor in {timeout:.0f}s:\n{proc.stderr}\n"
                + log_tail("kueue")
            )
        time.sleep(0.5)


def kueue_up(build_binary: bool = False) -> bool:
    """Start Kueue against the running control plane (CRDs, namespace, certificate, Configuration,
    process, webhooks) and wait until its webhooks admit; False if one was running already (reused).
    Without `build_binary` a Kueue that is not built is an error that says how to build it."""
    t0 = time.monotonic()
    state = read_state()
    status = running_status()
    core = {n: alive for n, alive in status.items() if n not in OPTIONAL_COMPONENTS}
    if not state or not core or not all(core.values()):
        raise ClusterError(
            "the control plane is not running: start it with `python3 devcluster/devcluster.py up` "
            "(make cluster-up), then kueue-up"
        )
    pids = state["pids"]
    assert isinstance(pids, dict)
    ports = cluster_ports(state)
    kdir = STATE / "kueue"
    if status.get("kueue") and probe(f"http://{HOST}:{ports.kueue_health}/readyz"):
        print(f"kueue already running (pid {pids['kueue']}); log: {STATE / 'logs' / 'kueue.log'}")
        return False
    if "kueue" in pids:  # dead, or not ready: start it afresh
        kueue_down(quiet=True)
        pids.pop("kueue", None)
    binary = build(names=["kueue"])["kueue"] if build_binary else built_binary("kueue")
    if binary is None:
        raise ClusterError(
            "Kueue is not built: build it with `python3 devcluster/devcluster.py build kueue` "
            "(`build test` builds it with the other test binaries; see docs/development.md for the cold "
            "build time), or let `python3 devcluster/devcluster.py kueue-up` build it"
        )
    for port in (ports.kueue_webhook, ports.kueue_health, ports.kueue_metrics):
        check_port_free(port, "kueue")
    mod = kueue_module_dir()
    ca_bundle = _kueue_pki(kdir)
    _install_kueue_crds(mod, ca_bundle, ports)
    namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": KUEUE_NAMESPACE}}
    kubectl("apply", "-f", "-", input=json.dumps(namespace))
    config = kdir / "config.yaml"  # JSON, which Kueue's YAML loader reads
    config.write_text(json.dumps(kueue_config(ports, kdir / "certs"), indent=2) + "\n")
    comp = _kueue_component(binary, config, ports)
    (STATE / "logs").mkdir(parents=True, exist_ok=True)
    pids["kueue"] = start(comp)
    save_state(state)
    try:
        wait_healthy(comp, int(pids["kueue"]), None, timeout=120)
        hooks = kueue_webhook_configurations(mod, ports, ca_bundle)
        hook_list = {"apiVersion": "v1", "kind": "List", "items": hooks}
        kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=json.dumps(hook_list))
        _wait_kueue_admits()
    except BaseException:
        kueue_down(quiet=True)
        raise
    print(
        f"[kueue-up] Kueue {go_mod_version('kueue', KUEUE_MODULE)} ready in {time.monotonic() - t0:.1f}s "
        f"(pid {pids['kueue']}, webhook https://{HOST}:{ports.kueue_webhook}); "
        f"log: {STATE / 'logs' / 'kueue.log'}",
        flush=True,
    )
    return True


def kueue_down(quiet: bool = False) -> None:
    """Remove Kueue's webhook configurations (so nothing is sent to an absent webhook) and stop it. Its
    CRDs and objects stay; the CRDs' v1beta1<->v1beta2 conversion needs Kueue running again."""
    state = read_state()
    if not state:
        if not quiet:
            print("[kueue-down] the control plane is not running")
        return
    pids = state["pids"]
    assert isinstance(pids, dict)
    if pid_alive(int(pids.get("kube-apiserver", 0) or 0)):
        kubectl(
            "delete", "--ignore-not-found", "--wait=false",
            *(f"{kind.lower()}/{name}" for kind, name in KUEUE_WEBHOOK_CONFIGS.items()), check=False,
        )  # fmt: skip
    pid = pids.pop("kueue", None)
    if pid is not None:
        stop(int(pid))
    save_state(state)
    if not quiet:
        print("[kueue-down] Kueue stopped" if pid is not None else "[kueue-down] Kueue was not running")
