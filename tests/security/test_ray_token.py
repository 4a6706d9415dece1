"""A Ray head started with a job's token settings refuses whoever lacks the job's token, and runs the
operator's submission, which carries it.

The head's environment is resolved from the RayCluster the operator builds for the tiny job, as the
kubelet would resolve it: literal values as they are, the `secretKeyRef` from the Secret the operator
creates for the job. No pod runs here (KWOK), so the head is a local `ray start --head` with that
environment, on loopback and free ports, in its own process group.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from support import ROOT, VENV_BIN, free_port, terminate, wait_for

pytestmark = pytest.mark.security

KEY = b"k" * 32 + b"-security-test-key"
UID = "6f1c2a9e-0d3b-4c55-9e21-3b7d5c0a1f42"


def tiny_job() -> Any:
    from rlhf_api.spec import RLHFJob

    doc = yaml.safe_load((ROOT / "examples" / "rlhfjob-tiny.yaml").read_text())
    doc["metadata"] = {"name": "sec-tiny", "namespace": "team-a", "uid": UID}
    return RLHFJob.model_validate(doc)


def resolved_head_env(job: Any) -> dict[str, str]:
    """The head container's env as the kubelet would set it, from the operator's RayCluster and Secret."""
    from rlhf_operator import manifests
    from rlhf_operator.security import PolicyAccess

    rc = manifests.build_raycluster(job)
    objects = manifests.security_objects(job, KEY, PolicyAccess("rlhf-system", {"app": "op"}))
    secrets = {o["metadata"]["name"]: o["stringData"] for o in objects if o["kind"] == "Secret"}
    env: dict[str, str] = {}
    for entry in rc["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["env"]:
        if "value" in entry:
            env[entry["name"]] = entry["value"]
        else:
            ref = entry["valueFrom"]["secretKeyRef"]
            env[entry["name"]] = secrets[ref["name"]][ref["key"]]
    return env


@pytest.fixture(scope="module")
def token_head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """(dashboard URL, GCS address) of a Ray head with the tiny job's token settings."""
    env_of_job = resolved_head_env(tiny_job())
    assert env_of_job["RAY_AUTH_MODE"] == "token" and len(env_of_job["RAY_AUTH_TOKEN"]) == 64
    port, dash = free_port(), free_port()
    home = Path(tempfile.mkdtemp(prefix="rlhf-sec-home-"))  # no ~/.ray/auth_token of the machine's
    temp = Path(tempfile.mkdtemp(prefix="rlhf-sec-"))  # short: Ray's socket paths have a length limit
    env = {
        **os.environ,
        **env_of_job,
        "HOME": str(home),
        "PATH": f"{VENV_BIN}:{os.environ['PATH']}",
        "RAY_USAGE_STATS_ENABLED": "0",
    }
    env.pop("RAY_ADDRESS", None)
    log = (tmp_path_factory.mktemp("ray-token") / "ray-head.log").open("wb")
    proc = subprocess.Popen(
        [
            str(VENV_BIN / "ray"),
            "start",
            "--head",
            "--block",
            "--node-ip-address=127.0.0.1",
            f"--port={port}",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={dash}",
            "--num-cpus=1",
            "--include-dashboard=true",
            "--disable-usage-stats",
            f"--temp-dir={temp}",
            "--min-worker-port=31000",
            "--max-worker-port=31999",
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{dash}"

    def healthy() -> bool | None:
        if proc.poll() is not None:
            pytest.fail(f"the token-auth Ray head exited ({proc.returncode}); see {log.name}", pytrace=False)
        try:  # a public path: answers before and without authentication
            return httpx.get(f"{url}/api/gcs_healthz", timeout=2).status_code == 200 or None
        except httpx.HTTPError:
            return None

    try:
        wait_for(healthy, 120, "the token-auth Ray dashboard")
        yield url, f"127.0.0.1:{port}"
    finally:
        os.killpg(proc.pid, 15)
        terminate(proc)


def test_the_head_refuses_jobs_api_calls_without_the_jobs_token(token_head: tuple[str, str]) -> None:
    url, _ = token_head
    body = {"entrypoint": "echo pwned", "submission_id": "intruder"}
    assert httpx.get(f"{url}/api/authentication_mode", timeout=10).json() == {"authentication_mode": "token"}
    for headers, code in (({}, 401), ({"Authorization": "Bearer " + "0" * 64}, 403)):
        submit = httpx.post(f"{url}/api/jobs/", json=body, headers=headers, timeout=10)
        assert submit.status_code == code, (headers, submit.status_code, submit.text[:300])
        listing = httpx.get(f"{url}/api/jobs/", headers=headers, timeout=10)
        assert listing.status_code == code, (headers, listing.status_code)
    # Another job's token (same key, another uid) is refused too.
    from rlhf_operator.security import job_token

    other = job_token(KEY, "team-a", "sec-tiny", "00000000-0000-0000-0000-000000000000")
    refused = httpx.post(
        f"{url}/api/jobs/", json=body, headers={"Authorization": f"Bearer {other}"}, timeout=10
    )
    assert refused.status_code == 403, refused.status_code


def test_the_operators_submission_carries_the_token_and_runs(token_head: tuple[str, str]) -> None:
    from rlhf_operator import rayjobs
    from rlhf_operator.security import token_of

    url, _ = token_head
    token = token_of(KEY, tiny_job())  # what handlers.ray_token sends for this job
    with rayjobs.RayJobsClient(url, token=token) as rj:
        rj.submit("rlhf-sec-ok", f"{sys.executable} -c \"print('ran with the token')\"")
        info = wait_for(
            lambda: ((i := rj.get("rlhf-sec-ok")) and i.status in rayjobs.TERMINAL and i) or None,
            120,
            "the operator's submission to finish",
        )
    assert info.status == rayjobs.SUCCEEDED, info


def test_the_gcs_refuses_a_driver_without_the_token(token_head: tuple[str, str]) -> None:
    _, gcs = token_head
    home = tempfile.mkdtemp(prefix="rlhf-sec-client-")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(HOME=home, RAY_USAGE_STATS_ENABLED="0")
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", f"import ray; ray.init(address={gcs!r}); print('CONNECTED')"],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "CONNECTED" not in proc.stdout, out[-2000:]
    assert "auth" in out.lower() or "token" in out.lower(), out[-2000:]
    print(f"unauthenticated ray.init refused after {time.monotonic() - started:.1f}s")
