"""A rollout pod being deleted drains its Ray node, and the engine pool retires the engine on it.

A real two-node Ray cluster on this machine (a head and a worker node, each with one rollout slot, as
two rollout pods would have): the rollout container's preStop hook (`python -m rlhf_trainer.drain`) is
run for real against the worker node, then the pool that the weight-sync manager drives between
phases reads Ray's drain state. The engines are plain Ray actors standing in for vLLM engines (what the
pool does with an engine it retires is `ray.kill`, the same for both); the node, the drain and Ray's
draining table are real.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from rlhf_api.constants import ROLLOUT_RESOURCE
from testkit.support import VENV_BIN, free_port, terminate, wait_for

pytestmark = pytest.mark.trainer


def _ray_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    return {**env, "HOME": str(home), "RAY_USAGE_STATS_ENABLED": "0", "PATH": f"{VENV_BIN}:{env['PATH']}"}


@pytest.fixture
def two_nodes() -> Iterator[tuple[str, dict[str, str], Path]]:
    """(GCS address, environment, temp dir) of a head and a worker node, one rollout slot each."""
    home = Path(tempfile.mkdtemp(prefix="rlhf-drain-home-"))
    temp = Path(tempfile.mkdtemp(prefix="rlhf-drain-", dir="/tmp"))
    env = _ray_env(home)
    port = free_port()
    address = f"127.0.0.1:{port}"
    slot = json.dumps({ROLLOUT_RESOURCE: 1})
    common = ["--block", "--num-cpus=1", f"--resources={slot}", "--disable-usage-stats"]
    procs: list[subprocess.Popen[bytes]] = []
    log = (temp / "nodes.log").open("wb")
    try:
        start = [str(VENV_BIN / "ray"), "start", *common]
        head = [*start, "--head", f"--port={port}", "--include-dashboard=false", f"--temp-dir={temp}"]
        procs.append(
            subprocess.Popen(head, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        )
        wait_for(lambda: (temp / "ray_current_cluster").exists() or None, 120, "the Ray head")
        worker = [*start, f"--address={address}"]
        procs.append(
            subprocess.Popen(worker, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        )
        yield address, env, temp
    finally:
        for proc in procs:
            with_group(proc, signal.SIGTERM)
        # one grace period for both nodes (each `ray start --block` takes longer than it to exit): ~5 s, not ~10
        deadline = time.monotonic() + 5
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.0, deadline - time.monotonic()))
        for proc in procs:
            terminate(proc, grace=0)
            with_group(proc, signal.SIGKILL)


def with_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)


def test_the_hook_drains_the_pods_node_and_the_pool_retires_its_engine_before_the_next_sync(
    two_nodes: tuple[str, dict[str, str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    import ray
    from rlhf_trainer.rollout.pool import EnginePool, EngineSlot, draining_nodes

    address, env, _ = two_nodes
    monkeypatch.setenv("HOME", env["HOME"])
    ray.init(address=address)
    try:

        def both_nodes() -> list[dict[str, Any]] | None:
            nodes = [n for n in ray.nodes() if n.get("Alive")]  # type: ignore[no-untyped-call]
            return nodes if len(nodes) == 2 else None

        nodes = wait_for(both_nodes, 120, "the worker node to join")

        @ray.remote(num_cpus=0)
        class Engine:  # stands in for a vLLM engine: where it runs, and that it answers
            def node(self) -> str:
                return str(ray.get_runtime_context().get_node_id())

        pool = EnginePool({}, lambda i: ({}, None), tensor_parallel=1)
        # The driver's own node first: the drained node exits once idle (its engine retired), and an actor
        # whose owner's node is gone dies with it, so the node drained is the other one.
        mine = ray.get_runtime_context().get_node_id()
        nodes.sort(key=lambda n: n["NodeID"] != mine)
        for i, node in enumerate(nodes):
            strategy = ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(
                node["NodeID"], soft=False
            )
            handle = Engine.options(scheduling_strategy=strategy).remote()  # type: ignore[attr-defined]
            pool.slots.append(EngineSlot(i, handle, "ready", info={"node_id": ray.get(handle.node.remote())}))
        going = pool.slots[1].info["node_id"]
        assert pool.desired_from_cluster(9) == 2 and draining_nodes() == set()
        version = pool.membership_version

        # The rollout container's preStop hook, run as the kubelet runs it (the node named: both Ray nodes
        # of this machine share its address, which a pod's one node never does).
        t0 = time.monotonic()
        hook = subprocess.run(
            [sys.executable, "-m", "rlhf_trainer.drain", "--address", address, "--node-id", going, "--deadline-seconds", "30"],
            env=env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert hook.returncode == 0 and f"drain: Ray node {going} draining" in hook.stdout, (
            hook.stdout + hook.stderr
        )
        print(f"hook: {hook.stdout.strip()} (wall {time.monotonic() - t0:.1f} s)")

        draining = draining_nodes()
        assert draining == {going}, draining
        # The node is still alive (its deadline is the grace period), but it no longer counts as a slot.
        assert pool.desired_from_cluster(9, draining) == 1
        retired = pool.retire_draining(draining)
        assert [s.index for s in retired] == [1] and [s.index for s in pool.ready()] == [0]
        assert pool.membership_version == version + 1  # the next sync rebuilds its group without it

        def killed() -> bool | None:  # ray.kill is asynchronous: a call just after it may still be served
            try:
                ray.get(retired[0].handle.node.remote(), timeout=10)
            except ray.exceptions.RayActorError:
                return True
            return None

        wait_for(killed, 60, "the retired engine's actor killed")
        assert ray.get(pool.slots[0].handle.node.remote(), timeout=60) != going
        assert pool.retire_draining(draining) == []  # once
    finally:
        ray.shutdown()


def test_a_hook_that_cannot_drain_says_why_and_exits_0(tmp_path: Path) -> None:
    """No Ray cluster to drain: the hook must not fail the pod's deletion (a failed hook only makes an
    Event), and it says what went wrong in the container's log."""
    env = {**_ray_env(tmp_path), "RAY_ADDRESS": f"127.0.0.1:{free_port()}"}
    # Ray's GCS client waits for an absent GCS 1 s per connection (of 2) and then py_gcs_connect_timeout_s
    # (30 s by default) for the cluster id: the same error path, reached in about 5 s instead of 35.
    fast = {"RAY_gcs_rpc_server_connect_timeout_s": "1", "RAY_py_gcs_connect_timeout_s": "2"}
    hook = subprocess.run(
        [sys.executable, "-m", "rlhf_trainer.drain", "--node-id", "ab" * 28, "--deadline-seconds", "5"],
        env={**env, **fast}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert hook.returncode == 0, hook.stderr
    assert hook.stdout.startswith("drain: error: "), hook.stdout + hook.stderr[-1000:]
