"""A real MLflow tracking server for the io stage: `mlflow server` from its own environment (setup.sh links it
as .venv/bin/mlflow-server: the dev venv, like the trainer image, has only MLflow's client) on a free port, with
a sqlite backend and the artifacts it serves itself in a temporary directory.

Owns: starting and stopping the process and its state directory. It must not stand in for any MLflow
call: tests log and read back through MLflow's own client over HTTP (docs/development.md).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from testkit.object_store import POD_GATEWAY
from testkit.support import VENV_BIN, free_port, terminate


@dataclass(frozen=True)
class MlflowServer:
    """A running tracking server: its URL from this machine and from pods, its state and log files."""

    url: str
    pod_url: str | None
    state: Path
    log: Path


def _wait_up(proc: subprocess.Popen[bytes], url: str, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"mlflow server exited with {proc.returncode}: {log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise AssertionError(
        f"mlflow server did not answer at {url} within {timeout:.0f}s: {log.read_text()[-3000:]}"
    )


@contextmanager
def running_mlflow_server(
    workdir: Path, *, for_pods: bool = False, timeout: float = 120, port: int | None = None
) -> Iterator[MlflowServer]:
    """`mlflow server` (one worker) on a free port (or `port`: a server restarted where its clients
    expect it): on loopback, or on every address (`for_pods`) so that pods reach it through the dev
    cluster's gateway. Its runs and artifacts live under `workdir` (a restart keeps them)."""
    binary = VENV_BIN / "mlflow-server"
    if not binary.exists():
        raise AssertionError(
            f"{binary} not found: scripts/setup.sh installs the MLflow server in its own environment and "
            "links it there (run `make setup`)"
        )
    state = workdir / "mlflow"
    state.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    host = "0.0.0.0" if for_pods else "127.0.0.1"
    allowed = f"127.0.0.1:{port},localhost:{port}" + (f",{POD_GATEWAY}:{port}" if for_pods else "")
    command = [
        str(binary), "server",
        "--backend-store-uri", f"sqlite:///{state / 'mlflow.db'}",
        "--artifacts-destination", str(state / "artifacts"),
        "--host", host, "--port", str(port), "--workers", "1",
        "--allowed-hosts", allowed,
    ]  # fmt: skip
    log = workdir / "mlflow_server.log"
    # Without MLflow's job runner (GenAI jobs, which nothing here uses): a second heavy Python process and
    # its periodic tasks on the same sqlite store roughly double the start-up under load (measured with
    # both cores busy: 43-51 s with it, 19-25 s without), which is what a restart mid-run waits for.
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    with log.open("wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=out, cwd=state, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_up(proc, url, log, timeout)
        yield MlflowServer(url, f"http://{POD_GATEWAY}:{port}" if for_pods else None, state, log)
    finally:
        _stop(proc)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """The server and its worker processes (its own session), SIGTERM then SIGKILL."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
    terminate(proc, grace=15)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # any worker left behind
