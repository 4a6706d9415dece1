"""Two operator replicas: only the Lease holder acts; the other takes over when it dies or stops.

Two real `rlhf operator --leader-elect` processes against the real API server (as two pods of the
chart's Deployment would run, with POD_NAME and POD_NAMESPACE from the downward API). Jobs here are
suspended, so the operator creates their RayClusters but no trainer runs: what is measured is who acts.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from support import Cluster, OperatorProcess, RayHead, wait_for
from test_operator_lifecycle import failing_job

pytestmark = pytest.mark.cluster
LEASE = "rlhf-operator-leader"
# kopf logs this once it runs, i.e. once a replica acts; a follower never gets that far.
ACTING = "watch-stream"


def holder(cluster: Cluster, namespace: str) -> str | None:
    lease: dict[str, Any] = cluster.get("lease", LEASE, namespace) or {}
    return lease.get("spec", {}).get("holderIdentity")


def log_of(op: OperatorProcess) -> str:
    return op.log_path.read_text(errors="replace") if op.log_path.exists() else ""


def submit(cluster: Cluster, namespace: str, name: str) -> float:
    """Apply a suspended job; return how long until its RayCluster exists (someone acted on it)."""
    t0 = time.monotonic()
    cluster.apply(failing_job(name, **{"spec.runPolicy.suspend": True}), namespace)
    wait_for(lambda: cluster.get("raycluster", name, namespace), 60, f"the RayCluster of {name}")
    return time.monotonic() - t0


def test_only_the_leader_acts_and_a_follower_takes_over(
    cluster: Cluster, namespace: str, rlhf_crd: str, ray_head: RayHead, tmp_path: Path
) -> None:
    env = {"RLHF_LEADER_ELECTION": "true", "POD_NAMESPACE": namespace}
    a = OperatorProcess(cluster, tmp_path / "a.log")
    b = OperatorProcess(cluster, tmp_path / "b.log")
    a2 = OperatorProcess(cluster, tmp_path / "a2.log")
    try:
        a.start(POD_NAME="op-a", **env)
        wait_for(lambda: holder(cluster, namespace) == "op-a" or None, 60, "op-a to take the Lease")
        b.start(POD_NAME="op-b", **env)
        wait_for(lambda: "op-b waits" in log_of(b) or None, 60, "op-b waiting for the Lease")

        submit(cluster, namespace, "one")
        time.sleep(3)  # give a wrongly acting follower time to show itself
        assert ACTING in log_of(a), "the leader's log shows no kopf activity: the check below proves nothing"
        assert ACTING not in log_of(b), f"the follower acted:\n{b.log_tail()}"
        assert holder(cluster, namespace) == "op-a"

        # The leader dies without a word (SIGKILL: no release): the follower waits out the lease.
        a.kill()
        t0 = time.monotonic()
        wait_for(lambda: holder(cluster, namespace) == "op-b" or None, 60, "op-b to take the Lease")
        took = time.monotonic() - t0
        acted = time.monotonic() - t0 + submit(cluster, namespace, "two")
        print(
            f"leader SIGKILLed: follower holds the Lease after {took:.1f} s, acts on a new job after {acted:.1f} s"
        )
        assert took <= 15 + 2 * 2 + 3, took  # leaseDurationSeconds + two retry periods + slack

        # A clean stop (SIGTERM, as in a rolling update or a drain): the Lease is released at once.
        a2.start(POD_NAME="op-a2", **env)
        wait_for(lambda: "op-a2 waits" in log_of(a2) or None, 60, "op-a2 waiting for the Lease")
        b.stop()
        t1 = time.monotonic()
        wait_for(lambda: holder(cluster, namespace) == "op-a2" or None, 60, "op-a2 to take the Lease")
        took = time.monotonic() - t1
        acted = time.monotonic() - t1 + submit(cluster, namespace, "three")
        print(
            f"leader stopped cleanly: the other holds the Lease after {took:.1f} s, acts after {acted:.1f} s"
        )
        assert took <= 2 + 3, took  # one retry period + slack: no waiting for the lease to expire
        assert "released the Lease" in log_of(b), b.log_tail()
    finally:
        for op in (a, b, a2):
            op.stop()
