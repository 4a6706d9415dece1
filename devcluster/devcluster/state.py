"""The running cluster's record, state.json in the state directory: its processes, token and ports.
Read and written here only.
"""

from __future__ import annotations

import json

from devcluster.config import STATE
from devcluster.ports import Ports
from devcluster.processes import pid_alive


def read_state() -> dict[str, object] | None:
    path = STATE / "state.json"
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else None
    except json.JSONDecodeError:
        return None


def running_status() -> dict[str, bool]:
    state = read_state() or {}
    pids = state.get("pids", {})
    assert isinstance(pids, dict)
    return {name: pid_alive(int(pid)) for name, pid in pids.items()}


def cluster_ports(state: dict[str, object]) -> Ports:
    """The running cluster's ports; those its state lacks (a cluster started before they existed) from
    the environment, as `up` would have chosen them."""
    saved = state.get("ports", {})
    assert isinstance(saved, dict)
    known = Ports.from_env().__dict__
    return Ports(**{**known, **{k: int(v) for k, v in saved.items() if k in known}})


def save_state(state: dict[str, object]) -> None:
    (STATE / "state.json").write_text(json.dumps(state, indent=2))
