"""A real S3 server for the io stage: moto's server mode (`moto_server` from the dev venv) on a free port,
a real HTTP S3 endpoint with IAM authentication on, so a wrong key is refused as AWS would refuse it.

Owns: starting and stopping the process, its one access key (made through the server's own IAM API before
authentication takes effect), and the AWS variables a client or a pod reads. It must not patch boto3 or
stand in for any S3 call: tests talk to the server over HTTP like any client (docs/development.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from testkit.support import VENV_BIN, free_port, terminate

REGION = "us-east-1"
# Where pods reach a process on this machine: the dev cluster's bridge (devcluster/node.py GATEWAY).
POD_GATEWAY = "10.244.0.1"
# IAM calls moto serves unauthenticated before it checks every request: the three that make the key.
_SETUP_CALLS = 3
_ALLOW_ALL = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}


@dataclass(frozen=True)
class ObjectStore:
    """A running S3 server: its endpoint (from this machine and from pods) and its one valid key."""

    endpoint: str
    pod_endpoint: str | None
    access_key_id: str
    secret_access_key: str
    log: Path

    def env(self, *, for_pods: bool = False) -> dict[str, str]:
        """The AWS variables boto3 reads (a Secret's keys under spec.storage.s3.credentialsSecret)."""
        endpoint = self.pod_endpoint if for_pods else self.endpoint
        if endpoint is None:
            raise AssertionError("the object store was started for this machine only (for_pods=False)")
        return {
            "AWS_ACCESS_KEY_ID": self.access_key_id,
            "AWS_SECRET_ACCESS_KEY": self.secret_access_key,
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_REGION": REGION,
        }

    def client(self, **overrides: str) -> Any:
        """A boto3 S3 client with the valid key, or with `overrides` (e.g. a wrong secret)."""
        import boto3

        keys = {"aws_access_key_id": self.access_key_id, "aws_secret_access_key": self.secret_access_key}
        return boto3.client("s3", endpoint_url=self.endpoint, region_name=REGION, **{**keys, **overrides})

    def bucket(self, name: str) -> str:
        """Create bucket `name` (S3 names: 3 to 63 characters) if it does not exist; return its name."""
        client = self.client()
        if name not in {b["Name"] for b in client.list_buckets().get("Buckets", [])}:
            client.create_bucket(Bucket=name)
        return name

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        """Every key under `prefix` in `bucket`."""
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        return [o["Key"] for page in pages for o in page.get("Contents", [])]


def _make_key(endpoint: str) -> tuple[str, str]:
    """A user allowed everything and its access key, made through the server's IAM API."""
    import boto3

    iam = boto3.client(
        "iam",
        endpoint_url=endpoint,
        region_name=REGION,
        aws_access_key_id="setup",
        aws_secret_access_key="setup",
    )
    iam.create_user(UserName="rlhf-io")
    iam.put_user_policy(UserName="rlhf-io", PolicyName="all", PolicyDocument=json.dumps(_ALLOW_ALL))
    key = iam.create_access_key(UserName="rlhf-io")["AccessKey"]
    return str(key["AccessKeyId"]), str(key["SecretAccessKey"])


def _wait_up(proc: subprocess.Popen[bytes], endpoint: str, log: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"moto_server exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            httpx.get(f"{endpoint}/moto-api/", timeout=2)
            return
        except httpx.HTTPError:
            time.sleep(0.2)
    raise AssertionError(
        f"moto_server did not answer at {endpoint} within {timeout:.0f}s: {log.read_text()[-2000:]}"
    )


@contextmanager
def running_object_store(workdir: Path, *, for_pods: bool = False) -> Iterator[ObjectStore]:
    """moto's S3 server on a free port: on loopback, or on every address (`for_pods`) so that pods reach
    it through the dev cluster's gateway. Stopped (and its state gone: moto keeps it in memory) at exit."""
    binary = VENV_BIN / "moto_server"
    if not binary.exists():
        raise AssertionError(
            f"{binary} not found: the dev venv's `moto[server]` provides it (scripts/setup.sh)"
        )
    port = free_port()
    host = "0.0.0.0" if for_pods else "127.0.0.1"
    log = workdir / "moto_server.log"
    env = {**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": str(_SETUP_CALLS)}
    with log.open("wb") as out:
        proc = subprocess.Popen([str(binary), "-H", host, "-p", str(port)], stdout=out, stderr=out, env=env)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        _wait_up(proc, endpoint, log)
        key_id, secret = _make_key(endpoint)
        pod_endpoint = f"http://{POD_GATEWAY}:{port}" if for_pods else None
        yield ObjectStore(endpoint, pod_endpoint, key_id, secret, log)
    finally:
        terminate(proc, grace=10)
