"""A component as a background process: how it is started (its own session, its log in the state
directory), probed for health, waited on and stopped. It knows no component by name beyond the API
server's token.
"""

from __future__ import annotations

import contextlib
import os
import signal
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from devcluster.config import STATE, ClusterError


@dataclass
class Component:
    """A process of the control plane: how to start it, where it listens, and how to tell it is healthy."""

    name: str
    args: list[str]
    ports: list[int]
    health_url: str
    env: dict[str, str] = field(default_factory=dict)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child of ours counts as dead.
    with contextlib.suppress(OSError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        if stat.rsplit(")", 1)[1].split()[0] == "Z":
            return False
    return True


def log_tail(name: str, lines: int = 25) -> str:
    log = STATE / "logs" / f"{name}.log"
    if not log.exists():
        return f"(no log at {log})"
    text = log.read_text(errors="replace").splitlines()
    return "\n".join(f"    {line}" for line in text[-lines:])


def _ssl_context() -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(STATE / "pki" / "ca.crt"))
    return ctx


def _insecure_context() -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def probe(url: str, token: str | None = None) -> bool:
    req = urllib.request.Request(url)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    ctx: ssl.SSLContext | None = None
    if url.startswith("https://"):
        # Controller-manager and scheduler serve self-signed certificates; only the API server is ours.
        ctx = _ssl_context() if token else _insecure_context()
    try:
        with urllib.request.urlopen(req, timeout=3, context=ctx) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError, ssl.SSLError):
        return False


def start(component: Component) -> int:
    log = (STATE / "logs" / f"{component.name}.log").open("ab")
    env = dict(os.environ)
    env.update(component.env)
    proc = subprocess.Popen(
        component.args,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        env=env,
        cwd=STATE,
    )
    return proc.pid


def wait_healthy(component: Component, pid: int, token: str | None, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            raise ClusterError(
                f"{component.name} exited during start-up. Last lines of its log:\n{log_tail(component.name)}"
            )
        if probe(component.health_url, token if component.name == "kube-apiserver" else None):
            return
        time.sleep(0.3)
    raise ClusterError(
        f"{component.name} did not become healthy at {component.health_url} in {timeout:.0f}s. "
        f"Last lines of its log:\n{log_tail(component.name)}"
    )


def stop(pid: int) -> None:
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if not pid_alive(pid):
                return
            time.sleep(0.1)
