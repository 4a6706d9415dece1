"""The benchmark's own control plane (devcluster, in RLHF_CLUSTER_DIR with its own ports) and the
processes it starts beside it: admin API clients, the chart's RBAC and a token for the operator's
ServiceAccount, and a child process that is always stopped.
"""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lib import common

import devcluster

ROOT = common.ROOT
WORK = Path("/tmp/rlhf-bench-opscale")
STATE: Path = devcluster.STATE
OPERATOR_NS = "rlhf-system"


def kubectl(*args: str, input: str | None = None) -> str:
    return str(devcluster.kubectl(*args, input=input).stdout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def api_clients(threads: int) -> tuple[Any, Any]:
    """(CustomObjectsApi, CoreV1Api) as admin, with a connection per client thread."""
    from kubernetes import client, config

    api_client = config.new_client_from_config(config_file=str(STATE / "kubeconfig"))  # type: ignore[no-untyped-call]
    api_client.configuration.connection_pool_maxsize = max(16, threads) + 4
    api_client.rest_client = client.rest.RESTClientObject(api_client.configuration)
    return client.CustomObjectsApi(api_client), client.CoreV1Api(api_client)


def install_rbac() -> str:
    """The chart's ServiceAccount and cluster-wide RBAC, as `helm template` renders them; returns the
    ServiceAccount's user name."""
    helm = str(devcluster.binary_path("helm"))
    rendered = subprocess.run(
        [
            helm,
            "template",
            "rlhf-operator",
            str(ROOT / "charts" / "rlhf-operator"),
            f"--namespace={OPERATOR_NS}",
            f"--kube-version={devcluster.KUBERNETES_VERSION}",
            "--show-only=templates/serviceaccount.yaml",
            "--show-only=templates/rbac.yaml",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    kubectl("create", "namespace", OPERATOR_NS)
    kubectl("apply", "-n", OPERATOR_NS, "-f", "-", input=rendered)
    import yaml

    sa = next(d for d in yaml.safe_load_all(rendered) if d and d["kind"] == "ServiceAccount")
    return f"system:serviceaccount:{OPERATOR_NS}:{sa['metadata']['name']}"


def operator_kubeconfig(username: str) -> Path:
    """The admin kubeconfig's server with a fresh token of the operator's ServiceAccount instead."""
    sa = username.rsplit(":", 1)[1]
    token = kubectl("-n", OPERATOR_NS, "create", "token", sa, "--duration=6h").strip()
    admin = json.loads((STATE / "kubeconfig").read_text())
    path = WORK / "operator.kubeconfig"
    path.write_text(
        json.dumps(
            {
                **admin,
                "users": [{"name": sa, "user": {"token": token}}],
                "contexts": [{"name": sa, "context": {"cluster": admin["clusters"][0]["name"], "user": sa}}],
                "current-context": sa,
            }
        )
    )
    path.chmod(0o600)
    return path


def wait_http(url: str, timeout: float, proc: subprocess.Popen[bytes], what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited ({proc.returncode}); see {WORK}")
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2) as r:
            if r.status == 200:
                return
        time.sleep(0.3)
    raise RuntimeError(f"{what} not healthy at {url} in {timeout:.0f}s; see {WORK}")


@contextlib.contextmanager
def process(cmd: list[str], env: dict[str, str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
