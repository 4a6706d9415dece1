"""The chart's Ray token key, and with it every job's token, survives `helm upgrade` on a live install.

The chart is installed on the local control plane. Its operator pod is KWOK's and runs nothing, so the
operator runs as a local process with the key as the pod would mount it (the Secret the release's
Deployment names), watching only the release's jobs namespace. Every release, operator and namespace a
test starts is gone when it ends, whatever happened (no operator outlives its test to act on another's
jobs).
"""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml
from testkit.support import ROOT, Cluster, OperatorProcess, drop_rlhfjobs, free_port, wait_for

pytestmark = pytest.mark.security

CHART = ROOT / "charts" / "rlhf-operator"
RELEASE = "sec-key"  # the chart's fullname is then "sec-key-rlhf-operator"


@contextmanager
def chart_release(cluster: Cluster, prefix: str) -> Iterator[tuple[str, str]]:
    """(release namespace, jobs namespace): the chart installed in a fresh namespace, watching a second
    one; uninstalled and both namespaces deleted afterwards."""
    suffix = uuid.uuid4().hex[:5]
    release_ns, jobs_ns = f"{prefix}-{suffix}", f"{prefix}-jobs-{suffix}"
    try:
        for ns in (release_ns, jobs_ns):
            cluster.kubectl("create", "namespace", ns)
        cluster.helm("install", RELEASE, str(CHART), "-n", release_ns, *chart_args(jobs_ns))
        yield release_ns, jobs_ns
    finally:
        cluster.helm("uninstall", RELEASE, "-n", release_ns, "--wait", check=False)
        drop_rlhfjobs(cluster, jobs_ns)  # the operators are stopped by now
        for ns in (jobs_ns, release_ns):
            cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def chart_args(jobs_ns: str, *values: str) -> list[str]:
    watch = f"watchNamespaces={json.dumps([jobs_ns])}"
    # No ClusterRLHFRuntime: two releases are installed at once below, and Helm refuses to make the
    # cluster-scoped `cpu-dev` for one while the other owns it.
    no_runtime = ["--set", "runtimes.cpuDev.enabled=false"]
    return ["--wait", "--timeout", "120s", "--set-json", watch, *no_runtime, *values]


def mounted_key(cluster: Cluster, release_ns: str) -> tuple[bytes, str]:
    """(key, the Secret's uid): the Secret the release's Deployment mounts as the key file, read as the
    kubelet would mount it."""
    dep = cluster.get("deployment", f"{RELEASE}-rlhf-operator", release_ns)
    assert dep is not None, "the release's Deployment"
    volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    secret = cluster.get("secret", volumes["ray-token-key"]["secret"]["secretName"], release_ns)
    assert secret is not None, "the release's Ray token key Secret"
    return base64.b64decode(secret["data"]["key"]), secret["metadata"]["uid"]


@contextmanager
def operator_with_key(
    cluster: Cluster, release_ns: str, jobs_ns: str, key: bytes, log: Path
) -> Iterator[OperatorProcess]:
    """The operator as the release's pod runs it, as far as tokens go: the key file, the release's
    namespace, the watched namespace. The dev head override points where nothing listens: no trainer."""
    key_file = log.with_suffix(".key")
    key_file.write_bytes(key)
    op = OperatorProcess(
        cluster,
        log,
        {
            "RLHF_RAY_TOKEN_KEY_FILE": str(key_file),
            "RLHF_DEV_DASHBOARD_PORT": str(free_port()),
            "POD_NAMESPACE": release_ns,
        },
        namespaces=[jobs_ns],
    )
    op.start()
    try:
        yield op
    finally:
        op.stop()
        print(f"--- operator log tail ({log.name}) ---\n{op.log_tail(15)}")


def job_token_secret(cluster: Cluster, jobs_ns: str, name: str) -> tuple[str, dict[str, Any]]:
    """(the job's uid, its token Secret) once the operator made it, for the tiny job `name` applied now."""
    doc = yaml.safe_load((ROOT / "examples" / "rlhfjob-tiny.yaml").read_text())
    doc["metadata"] = {"name": name}
    cluster.apply(doc, jobs_ns)
    job = wait_for(lambda: cluster.get("rlhfjob", name, jobs_ns), 30, f"the RLHFJob {name}")
    uid: str = job["metadata"]["uid"]
    secret_name = f"{name}-ray-token-{uid[:8]}"
    secret = wait_for(lambda: cluster.get("secret", secret_name, jobs_ns), 60, f"Secret {secret_name}")
    return uid, secret


def token(secret: dict[str, Any]) -> str:
    return base64.b64decode(secret["data"]["token"]).decode()


def test_the_token_key_and_a_jobs_token_survive_helm_upgrade_and_reinstall(
    cluster: Cluster, rlhf_crd: str, tmp_path: Path
) -> None:
    from rlhf_operator.security import job_token

    with chart_release(cluster, "sec-key") as (release_ns, jobs_ns):
        key, key_uid = mounted_key(cluster, release_ns)
        assert len(key) >= 32, len(key)
        with operator_with_key(cluster, release_ns, jobs_ns, key, tmp_path / "before.log"):
            uid, secret = job_token_secret(cluster, jobs_ns, "before")
        assert token(secret) == job_token(key, jobs_ns, "before", uid)

        # An upgrade with a changed value: the release's revision moves and its Deployment changes.
        changed = chart_args(jobs_ns, "--set", "operator.verbose=true")
        cluster.helm("upgrade", RELEASE, str(CHART), "-n", release_ns, *changed)
        status = json.loads(cluster.helm("status", RELEASE, "-n", release_ns, "-o", "json").stdout)
        assert status["version"] == 2, status["version"]
        dep = cluster.get("deployment", f"{RELEASE}-rlhf-operator", release_ns)
        assert dep is not None and "--verbose" in dep["spec"]["template"]["spec"]["containers"][0]["args"]

        # The key is the same object with the same bytes, and the job's Secret was not touched.
        assert mounted_key(cluster, release_ns) == (key, key_uid), "helm upgrade changed the Ray token key"
        kept = cluster.get("secret", secret["metadata"]["name"], jobs_ns)
        assert kept is not None and kept["data"] == secret["data"]
        assert kept["metadata"]["resourceVersion"] == secret["metadata"]["resourceVersion"]
        # The upgraded release's operator (the key as its new pod mounts it) gives a new job a token from
        # the same key, and still derives the earlier job's token as that job's pods hold it.
        key_after, _ = mounted_key(cluster, release_ns)
        with operator_with_key(cluster, release_ns, jobs_ns, key_after, tmp_path / "after.log"):
            uid_after, secret_after = job_token_secret(cluster, jobs_ns, "after")
        assert token(secret_after) == job_token(key, jobs_ns, "after", uid_after)
        assert job_token(key_after, jobs_ns, "before", uid) == token(kept)

        # Uninstalled and installed again, the release keeps its key (helm.sh/resource-policy: keep).
        cluster.helm("uninstall", RELEASE, "-n", release_ns, "--wait")
        assert cluster.get("deployment", f"{RELEASE}-rlhf-operator", release_ns) is None
        cluster.helm("install", RELEASE, str(CHART), "-n", release_ns, *chart_args(jobs_ns))
        assert mounted_key(cluster, release_ns) == (key, key_uid), "a reinstall changed the Ray token key"

        # Positive control: a fresh install elsewhere makes its own key, and its operator would derive
        # another token for the same job, so the comparisons above can fail.
        with chart_release(cluster, "sec-key-other") as (other_ns, _):
            other_key, other_uid = mounted_key(cluster, other_ns)
        assert other_key != key and other_uid != key_uid
        assert job_token(other_key, jobs_ns, "before", uid) != token(kept)
