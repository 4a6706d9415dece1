"""The lowest Kubernetes the chart claims (Chart.yaml kubeVersion), run for real: a kube-apiserver of
that minor's newest patch (devcluster/go/kubernetes-floor) takes the generated RLHFJob CRD, admits and
defaults the examples, refuses every invalid manifest naming its field, and keeps the create-only rule
create-only. It runs its own API server on the dev cluster's etcd under its own prefix, never the main one.
"""

from __future__ import annotations

import base64
import json
import re
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import yaml
from rlhf_api.rules import RULES
from rlhf_api.spec import RLHFJobSpec
from testkit.support import (
    CRD_FILE,
    EXAMPLE_JOBS,
    INVALID_MANIFESTS,
    ROOT,
    Cluster,
    free_port,
    terminate,
    wait_for,
)
from testkit.support import manifest_header as header
from testkit.support import minimal_job as job

if TYPE_CHECKING:  # mypy sees devcluster/ as a namespace package; conftest puts the script on sys.path
    from devcluster import devcluster
else:
    import devcluster

# Its own stage, last in `make test`: its API server is built in the background while other stages run.
INVALID, EXAMPLES = INVALID_MANIFESTS, EXAMPLE_JOBS
RULE_MESSAGES = {rule.name: rule.message for rule in RULES}
pytestmark = pytest.mark.floor

FLOOR_BINARY = "kube-apiserver-floor"
FLOOR_MODULE = devcluster.GO_DIR / "kubernetes-floor" / "go.mod"
CHART = ROOT / "charts" / "rlhf-operator"
CREATE_ONLY_RULE = RULE_MESSAGES["engines-within-autoscaling-range"]


@dataclass
class Floor:
    """The floor API server: a Cluster handle on it (the dev cluster's kubectl), its version, a namespace."""

    api: Cluster
    version: str  # what its /version says, e.g. v1.30.14
    namespace: str


def pinned_version() -> str:
    """The k8s.io/kubernetes version the floor module requires (its go.mod)."""
    found = re.search(r"^require k8s\.io/kubernetes (v\S+)$", FLOOR_MODULE.read_text(), re.MULTILINE)
    assert found, f"{FLOOR_MODULE} does not require k8s.io/kubernetes on one line"
    return found.group(1)


def claimed_floor() -> tuple[int, int]:
    """(major, minor) of the lowest Kubernetes Chart.yaml's kubeVersion admits (">=1.30.0-0")."""
    claim = str(yaml.safe_load((CHART / "Chart.yaml").read_text())["kubeVersion"])
    found = re.fullmatch(r">=\s*v?(\d+)\.(\d+)\.0(-0)?", claim.strip())
    assert found, f"Chart.yaml kubeVersion {claim!r} is not a plain lower bound `>=X.Y.0-0`"
    return int(found.group(1)), int(found.group(2))


def floor_args(binary: Path, port: int, prefix: str) -> list[str]:
    """The main API server's flags (devcluster.components) on another port and etcd prefix, without its
    audit log: the tests that read that log must only see the main server's writes."""
    state = devcluster.read_state()
    assert state, "no .cluster/state.json: the control plane is not running"
    ports = devcluster.Ports(**state["ports"])  # type: ignore[arg-type]
    bins = {b.name: devcluster.binary_path(b.name) for b in devcluster.BINARIES}
    main = next(c for c in devcluster.components(bins, ports) if c.name == "kube-apiserver")
    args = [f"--secure-port={port}" if a.startswith("--secure-port=") else a for a in main.args[1:]]
    return [str(binary), *(a for a in args if not a.startswith("--audit-")), f"--etcd-prefix={prefix}"]


def delete_etcd_prefix(prefix: str) -> None:
    """Delete every key under `prefix` through etcd's JSON gateway (the floor server's whole state)."""
    state = devcluster.read_state() or {}
    etcd_port = int(state["ports"]["etcd_client"])  # type: ignore[index]
    end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
    body = {k: base64.b64encode(v.encode()).decode() for k, v in (("key", prefix), ("range_end", end))}
    req = urllib.request.Request(
        f"http://{devcluster.HOST}:{etcd_port}/v3/kv/deleterange", data=json.dumps(body).encode()
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert resp.status == 200, f"deleting {prefix} from etcd: HTTP {resp.status}"


def wait_ready(proc: subprocess.Popen[bytes], url: str, token: str, log: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the floor API server exited ({proc.returncode}):\n{tail(log)}", pytrace=False)
        if devcluster.probe(url, token):
            return
        time.sleep(0.5)
    pytest.fail(f"the floor API server was not ready at {url} in {timeout:.0f}s:\n{tail(log)}", pytrace=False)


def tail(log: Path, lines: int = 30) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:]) if log.exists() else "(no log)"


@pytest.fixture(scope="module")
def floor(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Floor]:
    """The floor kube-apiserver on a free loopback port, against the running etcd, with the RLHFJob CRD."""
    binary = devcluster.binary_path(FLOOR_BINARY)
    if not binary.exists():
        pytest.fail(
            f"missing {binary} (the {FLOOR_BINARY} build of {FLOOR_MODULE.parent}): "
            "run `python3 devcluster/devcluster.py build`",
            pytrace=False,
        )
    token = str((devcluster.read_state() or {})["token"])
    port, prefix = free_port(), f"/rlhf-floor-{uuid.uuid4().hex[:8]}/"
    work = tmp_path_factory.mktemp("floor")
    log = work / "kube-apiserver-floor.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            floor_args(binary, port, prefix),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    try:
        wait_ready(proc, f"https://{devcluster.HOST}:{port}/readyz", token, log)
        devcluster.write_kubeconfig(work / "kubeconfig", devcluster.STATE / "pki" / "ca.crt", token, port)
        api = Cluster(kubeconfig=work / "kubeconfig", bin_dir=cluster.bin_dir)
        version = json.loads(api.kubectl("get", "--raw", "/version").stdout)["gitVersion"]
        apply_crd(api, log)
        namespace = f"floor-{uuid.uuid4().hex[:6]}"
        api.kubectl("create", "namespace", namespace)
        yield Floor(api=api, version=version, namespace=namespace)
    finally:
        terminate(proc)
        delete_etcd_prefix(prefix)
        print(f"--- floor API server log tail ---\n{tail(log)}")


def apply_crd(api: Cluster, log: Path) -> None:
    """Server-side apply the committed CRD and wait for Established; a refusal means the claim is wrong."""
    proc = api.kubectl("apply", "--server-side", "-f", str(CRD_FILE), check=False)
    if proc.returncode != 0:
        pytest.fail(
            f"the floor API server refused the RLHFJob CRD: raise kubeVersion in Chart.yaml.\n{proc.stderr}",
            pytrace=False,
        )

    def established() -> str | None:
        crd = json.loads(api.kubectl("get", "crd/rlhfjobs.rlhf.dev", "-o", "json").stdout)
        conditions = {c["type"]: c for c in (crd.get("status") or {}).get("conditions") or []}
        return "yes" if conditions.get("Established", {}).get("status") == "True" else None

    wait_for(established, 60, f"the RLHFJob CRD Established on the floor API server (log: {log})")
    wait_for(  # the resource is served a moment after Established
        lambda: api.kubectl("get", "rlhfjobs", "-A", check=False).returncode == 0 or None,
        60,
        "rlhfjobs served by the floor API server",
    )


def test_floor_is_the_lowest_claimed_minor(floor: Floor) -> None:
    """The server under test is the version pinned in the floor module and the minor Chart.yaml claims."""
    assert floor.version == pinned_version(), f"/version says {floor.version}, go.mod pins {pinned_version()}"
    major, minor = (int(n) for n in floor.version.lstrip("v").split(".")[:2])
    assert (major, minor) == claimed_floor(), (
        f"Chart.yaml claims Kubernetes >= {claimed_floor()} but the floor test runs {floor.version}"
    )


def test_crd_keeps_its_create_only_rule_on_the_floor(floor: Floor) -> None:
    """1.30 stored the rule with optionalOldSelf (an older server drops the field and refuses the CRD)."""
    crd = json.loads(floor.api.kubectl("get", "crd/rlhfjobs.rlhf.dev", "-o", "json").stdout)
    rollout = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"][
        "rollout"
    ]
    create_only = [r for r in rollout["x-kubernetes-validations"] if r["message"] == CREATE_ONLY_RULE]
    assert len(create_only) == 1 and create_only[0].get("optionalOldSelf") is True, create_only


@pytest.mark.parametrize("path", INVALID, ids=[p.stem for p in INVALID])
def test_floor_rejects_invalid_manifest_naming_its_field(floor: Floor, path: Path) -> None:
    """The same expectations as test_admission's against the main API server."""
    expected = header(path)
    proc = floor.api.kubectl("apply", "-n", floor.namespace, "-f", "-", input=path.read_text(), check=False)
    assert proc.returncode != 0, f"{path.name} was accepted by {floor.version}:\n{proc.stdout}"
    assert expected["expect"] in proc.stderr, proc.stderr
    if "rule" in expected:
        assert RULE_MESSAGES[expected["rule"]] in proc.stderr, proc.stderr


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_floor_admits_and_defaults_examples_like_the_model(floor: Floor, path: Path) -> None:
    name = f"{path.stem}-{uuid.uuid4().hex[:5]}"
    manifest = yaml.safe_load(path.read_text())
    manifest["metadata"]["name"] = name
    floor.api.apply(manifest, floor.namespace)
    stored = floor.api.get("rlhfjob", name, floor.namespace)
    assert stored is not None, f"{path.name} was applied but is not stored"
    by_model = RLHFJobSpec.model_validate(manifest["spec"]).model_dump(
        by_alias=True, exclude_none=True, mode="json"
    )
    assert stored["spec"] == by_model


def test_create_only_rule_holds_on_create_and_lets_updates_leave_the_range(floor: Floor) -> None:
    """The transition rule (optionalOldSelf) refuses a create outside the autoscaling range and lets a
    later scale leave it; the other rules and schema bounds still refuse bad updates."""
    ns, api = floor.namespace, floor.api

    def autoscaled(name: str, engines: int) -> dict[str, Any]:
        scaling = {"enabled": True, "minEngines": 1, "maxEngines": 2}
        return job(name, rollout={"engines": engines, "autoscaling": scaling})

    refused = api.kubectl(
        "create", "-n", ns, "-f", "-", input=json.dumps(autoscaled("born-big", 5)), check=False
    )
    assert refused.returncode != 0, f"a create outside the range was accepted:\n{refused.stdout}"
    assert "spec.rollout.engines" in refused.stderr and CREATE_ONLY_RULE in refused.stderr, refused.stderr

    api.kubectl("create", "-n", ns, "-f", "-", input=json.dumps(autoscaled("grown", 2)))
    scaled = api.kubectl("scale", "-n", ns, "rlhfjob/grown", "--replicas=5", check=False)
    assert scaled.returncode == 0, f"scaling out of the range after create was refused:\n{scaled.stderr}"
    patched = api.kubectl(
        "patch", "-n", ns, "rlhfjob/grown", "--type=merge", "-p", '{"spec":{"runPolicy":{"backoffLimit":7}}}',
        check=False,
    )  # fmt: skip
    assert patched.returncode == 0, (
        f"an unrelated update of an out-of-range job was refused:\n{patched.stderr}"
    )
    stored = api.get("rlhfjob", "grown", ns)
    assert stored is not None
    assert (stored["spec"]["rollout"]["engines"], stored["spec"]["runPolicy"]["backoffLimit"]) == (5, 7)

    inverted = api.kubectl(
        "patch", "-n", ns, "rlhfjob/grown", "--type=merge",
        "-p", '{"spec":{"rollout":{"autoscaling":{"minEngines":3}}}}', check=False,
    )  # fmt: skip
    assert inverted.returncode != 0, "an update making minEngines > maxEngines was accepted"
    assert "spec.rollout.autoscaling.minEngines" in inverted.stderr, inverted.stderr
    assert RULE_MESSAGES["autoscaling-min-at-most-max"] in inverted.stderr, inverted.stderr
    zero = api.kubectl("scale", "-n", ns, "rlhfjob/grown", "--replicas=0", check=False)
    assert zero.returncode != 0 and "spec.rollout.engines" in zero.stderr, zero.stderr


def test_chart_renders_for_the_floor_and_refuses_the_minor_below(floor: Floor, cluster: Cluster) -> None:
    major, minor = (int(n) for n in floor.version.lstrip("v").split(".")[:2])
    rendered = cluster.helm("template", "rlhf-operator", str(CHART), "--kube-version", floor.version)
    kinds = {doc["kind"] for doc in yaml.safe_load_all(rendered.stdout) if doc}
    assert "Deployment" in kinds, f"helm template for {floor.version} rendered {sorted(kinds)}"
    below = f"v{major}.{minor - 1}.0"
    refused = cluster.helm("template", "rlhf-operator", str(CHART), "--kube-version", below, check=False)
    assert refused.returncode != 0, f"helm template accepted Kubernetes {below}"
    assert "kubeVersion" in refused.stderr and below in refused.stderr, refused.stderr
