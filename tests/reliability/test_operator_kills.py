"""Operator and control-plane faults: the operator SIGKILLed again and again while 10 jobs are created and
run, and a RayCluster deleted by hand under a running job.

The 10 jobs use a reward function whose module does not exist: the real trainer entrypoint starts on the
local Ray head and fails within seconds, so each job goes Pending -> Provisioning -> (Running) -> Failed
(backoffLimit 0) in well under a minute. What is checked is the operator's bookkeeping under kills: one
RayCluster per job, one submission per job, every status converged.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import httpx
import pytest
from support import RAY_DASHBOARD_PORT, Cluster, OperatorProcess, tiny_job, wait_for

pytestmark = pytest.mark.reliability
JOBS = 10


def ray_submissions(prefix: str) -> list[str]:
    resp = httpx.get(f"http://127.0.0.1:{RAY_DASHBOARD_PORT}/api/jobs/", timeout=10)
    resp.raise_for_status()
    return [j["submission_id"] for j in resp.json() if str(j.get("submission_id", "")).startswith(prefix)]


class ClusterWatch:
    """Polls RayClusters in a namespace: every uid ever seen per job, and the most alive at once."""

    def __init__(self, cluster: Cluster, namespace: str) -> None:
        self.uids: dict[str, set[str]] = defaultdict(set)
        self.max_at_once: dict[str, int] = defaultdict(int)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(cluster, namespace), daemon=True)
        self._thread.start()

    def _run(self, cluster: Cluster, namespace: str) -> None:
        while not self._stop.is_set():
            alive: dict[str, int] = defaultdict(int)
            try:
                clusters = cluster.list("rayclusters", namespace)
            except Exception:  # the API server is away (a restart test): try again
                time.sleep(0.5)
                continue
            for rc in clusters:
                job = rc["metadata"].get("labels", {}).get("rlhf.dev/job", "?")
                self.uids[job].add(rc["metadata"]["uid"])
                alive[job] += 1
            for job, n in alive.items():
                self.max_at_once[job] = max(self.max_at_once[job], n)
            time.sleep(0.3)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


def test_operator_killed_repeatedly_while_ten_jobs_run(
    cluster: Cluster, namespace: str, operator: OperatorProcess, tiny_model: Path, tmp_path: Path
) -> None:
    watch = ClusterWatch(cluster, namespace)
    names = [f"job-{i}" for i in range(JOBS)]
    kills = 0
    t0 = time.monotonic()
    try:
        for i, name in enumerate(names):
            doc = tiny_job(name, tiny_model, tmp_path / name, steps=2, runPolicy={"backoffLimit": 0})
            doc["spec"]["model"]["reward"]["function"] = "rlhf_no_such_module:reward"
            cluster.apply(doc, namespace)
            if i % 3 == 2:  # kill mid-creation, a few times
                operator.kill()
                kills += 1
                operator.start()

        def statuses() -> dict[str, dict[str, Any]]:
            return {n: (cluster.get("rlhfjob", n, namespace) or {}).get("status", {}) for n in names}

        # Keep killing the operator at random points of its reconciliation until every job has settled.
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            sts = statuses()
            if all(s.get("phase") == "Failed" for s in sts.values()):
                break
            time.sleep(4)
            if kills < 8:
                operator.kill()
                kills += 1
                operator.start()
        else:
            pytest.fail(f"statuses did not converge: { {n: s.get('phase') for n, s in statuses().items()} }")
        converged = time.monotonic() - t0
        # The finished jobs release their RayClusters.
        wait_for(lambda: not cluster.list("rayclusters", namespace) or None, 120, "the RayClusters released")
    finally:
        watch.stop()
    print(f"\n{JOBS} jobs, operator SIGKILLed {kills} times: all converged to Failed in {converged:.0f}s")
    sts = statuses()
    for name in names:
        st = sts[name]
        assert "rlhf_no_such_module" in st.get("message", ""), (name, st)
        assert st.get("restarts", 0) == 0, (name, st)
        assert len(watch.uids[name]) == 1, f"{name}: RayClusters {watch.uids[name]} (one expected)"
        assert watch.max_at_once[name] == 1
        job = cluster.get("rlhfjob", name, namespace)
        assert job is not None
        prefix = f"rlhf-{namespace}-{name}-{job['metadata']['uid'][:8]}-"
        assert ray_submissions(prefix) == [prefix + "0"], f"{name} submitted more than once"
    assert kills >= 5


def test_a_raycluster_deleted_by_hand_is_recreated_with_a_warning(
    cluster: Cluster, namespace: str, operator: OperatorProcess, tiny_model: Path, tmp_path: Path
) -> None:
    """Policy (docs/reliability.md): the operator recreates the RayCluster, says so with a Warning Event
    `ClusterRecreated`, and the trainer goes on (on a real cluster it resumes from its checkpoint)."""
    cluster.apply(tiny_job("orphan", tiny_model, tmp_path / "ckpt", steps=200), namespace)
    try:

        def status() -> dict[str, Any]:
            return (cluster.get("rlhfjob", "orphan", namespace) or {}).get("status", {})

        wait_for(lambda: status().get("phase") == "Running" or None, 600, "the job Running")
        old = cluster.get("raycluster", "orphan", namespace)
        assert old is not None
        t0 = time.monotonic()
        cluster.kubectl("delete", "raycluster", "orphan", "-n", namespace, "--wait=false")

        def recreated() -> dict[str, Any] | None:
            rc = cluster.get("raycluster", "orphan", namespace)
            return rc if rc is not None and rc["metadata"]["uid"] != old["metadata"]["uid"] else None

        new = wait_for(recreated, 120, "a new RayCluster")
        assert new["metadata"]["ownerReferences"][0]["kind"] == "RLHFJob"

        def recreated_events() -> list[dict[str, Any]] | None:
            found = [
                e
                for e in cluster.list("events", namespace)
                if e["involvedObject"].get("name") == "orphan" and e["reason"] == "ClusterRecreated"
            ]
            return found or None

        warnings = wait_for(recreated_events, 60, "a ClusterRecreated event")
        assert warnings[0]["type"] == "Warning", warnings
        st = wait_for(lambda: ((s := status()).get("phase") == "Running" and s) or None, 300, "Running again")
        recovered = time.monotonic() - t0
        assert st.get("restarts", 0) == 0
        print(f"\nRayCluster deleted by hand: recreated and Running again after {recovered:.0f}s")
    finally:
        cluster.kubectl("delete", "rlhfjob", "orphan", "-n", namespace, "--wait=false", check=False)


def test_a_kube_apiserver_restart_neither_duplicates_nor_loses_an_action(
    cluster: Cluster, namespace: str, operator: OperatorProcess, tiny_model: Path, tmp_path: Path
) -> None:
    """The API server goes away while jobs are being reconciled (their first attempts fail and must be
    restarted exactly once): the operator reconnects, and every job ends with exactly one restart."""
    import devcluster

    names = [f"api-{i}" for i in range(3)]
    watch = ClusterWatch(cluster, namespace)
    try:
        for name in names:
            doc = tiny_job(name, tiny_model, tmp_path / name, steps=2, runPolicy={"backoffLimit": 1})
            doc["spec"]["model"]["reward"]["function"] = "rlhf_no_such_module:reward"
            cluster.apply(doc, namespace)
        wait_for(
            lambda: all((cluster.get("rlhfjob", n, namespace) or {}).get("status", {}).get("submissionId")
                        for n in names) or None,
            120,
            "every job's first attempt submitted",
        )  # fmt: skip
        down_for = devcluster.restart("kube-apiserver")
        t0 = time.monotonic()

        def all_failed() -> dict[str, dict[str, Any]] | None:
            sts = {n: (cluster.get("rlhfjob", n, namespace) or {}).get("status", {}) for n in names}
            return sts if all(s.get("phase") == "Failed" for s in sts.values()) else None

        sts = wait_for(all_failed, 300, "every job Failed after its one restart")
        converged = time.monotonic() - t0
    finally:
        watch.stop()
    assert operator.alive(), f"the operator died with the API server:\n{operator.log_tail()}"
    print(
        f"\nkube-apiserver restarted ({down_for:.1f}s until healthy); 3 jobs converged {converged:.0f}s later"
    )
    for name in names:
        assert sts[name]["restarts"] == 1, (name, sts[name])
        job = cluster.get("rlhfjob", name, namespace)
        assert job is not None
        prefix = f"rlhf-{namespace}-{name}-{job['metadata']['uid'][:8]}-"
        assert sorted(ray_submissions(prefix)) == [prefix + "0", prefix + "1"], name
        assert len(watch.uids[name]) == 1, f"{name}: RayClusters {watch.uids[name]}"
