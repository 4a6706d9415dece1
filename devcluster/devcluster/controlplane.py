"""The control plane's life cycle: `up` (build, credentials, start every component in order, wait
until each is healthy), `restart` of one component, `down` and `status`. Which processes, with
what flags, is component_args.py's; Kueue is kueue.py's.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time

import node

from devcluster.binaries import BINARIES, OPTIONAL_COMPONENTS, up_binaries
from devcluster.component_args import components
from devcluster.config import HOST, STATE, ClusterError
from devcluster.gobuild import binary_path, build
from devcluster.kube import install_kuberay_crds, kubectl, wait_default_objects
from devcluster.kueue import kueue_down
from devcluster.kwok import register_default_nodes
from devcluster.pki import make_pki, write_kubeconfig
from devcluster.ports import Ports, check_port_free
from devcluster.processes import log_tail, pid_alive, probe, start, stop, wait_healthy
from devcluster.real_node import drain_real_node, prepare_real_node, wait_real_node_ready
from devcluster.state import cluster_ports, read_state, running_status, save_state


def _forget_dead_optional() -> None:
    state = read_state()
    if not state:
        return
    pids = state.get("pids", {})
    assert isinstance(pids, dict)
    dead = [n for n in OPTIONAL_COMPONENTS if n in pids and not pid_alive(int(pids[n]))]
    for name in dead:
        print(f"[up] {name} had stopped; last lines of its log:\n{log_tail(name)}", file=sys.stderr)
        if name == "kueue":
            kueue_down(quiet=True)
        pids.pop(name, None)
    if dead:
        save_state(state)


def up() -> None:
    started_at = time.monotonic()
    _forget_dead_optional()
    status = running_status()
    if status and all(status.values()):
        token = str((read_state() or {}).get("token", ""))
        port = cluster_ports(read_state() or {}).apiserver
        if probe(f"https://{HOST}:{port}/readyz", token):
            print(
                f"control plane already running ({len(status)} components); kubeconfig: {STATE / 'kubeconfig'}"
            )
            return
    if status:
        dead = [n for n, alive in status.items() if not alive]
        for name in dead:
            print(f"[up] {name} is not running. Last lines of its log:\n{log_tail(name)}", file=sys.stderr)
        print("[up] restarting the control plane from scratch", file=sys.stderr)
        down(quiet=True)

    real_node = node.enabled()
    if real_node:
        node.install_packages()
        problems = node.missing_prerequisites()
        if problems:
            raise ClusterError(
                "the real node cannot run on this machine: missing " + "; ".join(problems) + ".\n"
                "Set RLHF_REAL_NODE=0 to start the control plane with KWOK nodes only."
            )
    bins = build(names=up_binaries(real_node))
    ports = Ports.from_env()
    comps = components(bins, ports, real_node)
    for comp in comps:
        for port in comp.ports:
            check_port_free(port, comp.name)

    for sub in ("logs", "etcd"):
        (STATE / sub).mkdir(parents=True, exist_ok=True)
    token = make_pki(STATE / "pki")
    write_kubeconfig(STATE / "kubeconfig", STATE / "pki" / "ca.crt", token, ports.apiserver)

    pids: dict[str, int] = {}
    state: dict[str, object] = {"pids": pids, "token": token, "ports": ports.__dict__, "real_node": real_node}

    def save() -> None:
        (STATE / "state.json").write_text(json.dumps(state, indent=2))

    try:
        for comp in comps:
            t0 = time.monotonic()
            if comp.name == "kubelet":
                pids["containerd"] = prepare_real_node(ports)
                save()
            pids[comp.name] = start(comp)
            save()
            if comp.name == "kuberay-operator":
                install_kuberay_crds()
            wait_healthy(comp, pids[comp.name], token)
            print(
                f"[up] {comp.name:<24} healthy in {time.monotonic() - t0:5.1f}s  (pid {pids[comp.name]})",
                flush=True,
            )
            if comp.name == "kube-apiserver":
                wait_default_objects()
            if comp.name == "kuberay-operator":
                register_default_nodes()
            if comp.name == "kubelet":
                wait_real_node_ready()
                kubectl(
                    "apply",
                    "-f",
                    "-",
                    input=json.dumps({"kind": "List", "apiVersion": "v1", "items": node.dns_objects()}),
                )
    except BaseException:
        down(quiet=True, keep_logs=True)
        raise
    print(
        f"[up] control plane ready in {time.monotonic() - started_at:.1f}s; "
        f"export KUBECONFIG={STATE / 'kubeconfig'}; logs in {STATE / 'logs'}"
    )


def restart(name: str) -> float:
    """Stop one running component (SIGTERM, then SIGKILL) and start it again with the same arguments and
    ports; returns the seconds until it was healthy again. For fault-injection tests."""
    state = read_state()
    if not state:
        raise ClusterError("the control plane is not running (make cluster-up)")
    pids = state["pids"]
    assert isinstance(pids, dict)
    if name not in pids:
        raise ClusterError(f"no component {name!r}; components: {', '.join(pids)}")
    if name == "kueue":
        raise ClusterError("restart Kueue with kueue-down then kueue-up")
    ports = Ports(**state["ports"])  # type: ignore[arg-type]
    bins = {b.name: binary_path(b.name) for b in BINARIES}
    comps = components(bins, ports, bool(state.get("real_node")))
    comp = next(c for c in comps if c.name == name)
    t0 = time.monotonic()
    stop(int(pids[name]))
    pids[name] = start(comp)
    (STATE / "state.json").write_text(json.dumps(state, indent=2))
    wait_healthy(comp, int(pids[name]), str(state.get("token", "")))
    return time.monotonic() - t0


def down(quiet: bool = False, keep_logs: bool = False) -> None:
    state = read_state() or {}
    pids = state.get("pids", {})
    assert isinstance(pids, dict)
    real_node = bool(state.get("real_node")) and "containerd" in pids  # ours to tear down
    if (
        real_node
        and pid_alive(int(pids.get("kubelet", 0) or 0))
        and pid_alive(int(pids.get("kube-apiserver", 0) or 0))
    ):
        drain_real_node()
    for name, pid in reversed(list(pids.items())):
        if name == "containerd":
            left = node.kill_containers(node.runtime_socket())
            node.runtime_down()
            if not quiet:
                print(f"[down] stopped containerd ({left} containers were still running)")
            continue
        stop(int(pid))
        if not quiet:
            print(f"[down] stopped {name}")
    if real_node:
        if binary_path("kube-proxy").exists():
            subprocess.run([str(binary_path("kube-proxy")), "--cleanup"], capture_output=True, timeout=60)
        node.unmount_under(STATE / "node")
        node.teardown_network()
    for sub in ("etcd", "pki", "state.json", "kubeconfig", "node") + (() if keep_logs else ("logs",)):
        path = STATE / sub
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        elif path.exists():
            path.unlink()
    if not quiet:
        print("[down] control plane stopped and state removed")


def status() -> int:
    st = running_status()
    if not st:
        print("control plane: not running")
        return 1
    bad = 0
    for name, alive in st.items():
        print(f"{name:<24} {'running' if alive else 'DEAD'}")
        if not alive:
            bad += 1
            print(log_tail(name))
    return 1 if bad else 0
