"""Operator and control-plane faults: the operator SIGKILLed again and again while 10 jobs start and run,
a RayCluster deleted by hand under a running job, and a kube-apiserver restart.

The 10 jobs of the kill test reach `Running` on STAND-IN TRAINERS: before the operator first starts, the
test submits a sleeping Ray job under each job's deterministic submission id (as the autoscaling tests
do), so the operator adopts it as the running trainer and no real trainer is started. What is checked
is the operator's bookkeeping under kills that land in the middle of its work: first at its own
failpoint right after a RayCluster create (before the job's status says so), then, once RayClusters
exist, each time the incarnation just started has moved one more job to `Running`; every kill is
preceded by evidence that the incarnation killed did work (a create the audit log counts, a job it
moved). Then: exactly one RayCluster create per job in the API server's audit log, the operator never
submitted a trainer of its own over the one it adopted, no restart, every job Running. (The operator's
own submission under a kill, exactly once, is `cluster/test_operator_lifecycle.py`'s `before_submit`
and `after_submit` points.)
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from rlhf_operator import rayjobs
from testkit.support import (
    START_FAULT,
    Cluster,
    OperatorProcess,
    PhaseWatch,
    RayHead,
    audited,
    audited_creates,
    ray_submissions,
    submit_standin_trainer,
    tiny_job,
    wait_for,
)

pytestmark = pytest.mark.reliability
JOBS = 10
# The kills: MID_CREATE_KILLS at the operator's `after_cluster_create` failpoint (it SIGKILLs itself
# between a RayCluster create and the status patch that records it), then RUNNING_KILLS SIGKILLs from
# outside, each the moment the incarnation started last has moved one more job to Running. Each kill
# needs progress since the previous one, so none can land on an incarnation that did nothing.
MID_CREATE_KILLS = 4
RUNNING_KILLS = 4
BATCHES = [[f"job-{i}" for i in part] for part in (range(0, 3), range(3, 6), range(6, 8), range(8, 10))]


class ClusterWatch:
    """Polls RayClusters in a namespace: every uid ever seen per job, and the most alive at once.

    A supplement to the audit log's create count (the proof): it also sees two alive at once.
    """

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


def test_operator_killed_repeatedly_while_ten_jobs_start_and_run(
    cluster: Cluster, rlhf_crd: str, namespace: str, ray_head: RayHead, tiny_model: Path, tmp_path: Path
) -> None:
    import devcluster

    # Each tiny job's pods ask for 5 (fake) GPUs; the dev cluster's 2 nodes hold 16. Six more KWOK nodes
    # for this test (removed at the end) let all 10 jobs run at once.
    extra = range(devcluster.NODES, devcluster.NODES + 6)
    devcluster.register_nodes(extra)
    names = [f"job-{i}" for i in range(JOBS)]
    sids: dict[str, str] = {}

    def add_jobs(batch: list[str]) -> None:
        """Apply jobs, and submit each one's stand-in trainer before the operator can see it."""
        for name in batch:
            doc = tiny_job(name, tiny_model, tmp_path / name, steps=2, runPolicy={"backoffLimit": 1})
            cluster.apply(doc, namespace)
            sids[name] = submit_standin_trainer(cluster, namespace, name)

    def statuses() -> dict[str, dict[str, Any]]:
        return {n: (cluster.get("rlhfjob", n, namespace) or {}).get("status", {}) for n in names}

    def running() -> int:
        return sum(s.get("phase") == "Running" for s in statuses().values())

    op = OperatorProcess(cluster, tmp_path / "operator.log")
    watch = ClusterWatch(cluster, namespace)
    progress: list[str] = []  # what each killed incarnation did, for the report and the assertions

    def creates() -> int:
        return sum(len(audited_creates("rayclusters", namespace, n)) for n in sids)

    t0 = time.monotonic()
    try:
        # 1. Mid-create: each incarnation runs until its first RayCluster create and kills itself there.
        # The jobs come in MID_CREATE_KILLS batches, one before each of these incarnations: one
        # incarnation creates the RayClusters of every job it sees at once (its creates overlap), so
        # each needs jobs of its own without one to reach its failpoint.
        for i, batch in enumerate(BATCHES):
            add_jobs(batch)
            before = creates()
            marker_dir = tmp_path / f"failpoints-{i}"
            op.start(RLHF_FAILPOINTS="after_cluster_create", RLHF_FAILPOINTS_DIR=str(marker_dir))
            wait_for(lambda: not op.alive() or None, 120, f"incarnation {i} to reach after_cluster_create")
            assert op.proc is not None and op.proc.returncode == -9, (op.proc, op.log_tail())
            marker = marker_dir / "after_cluster_create"
            assert marker.exists() and marker.read_text() == str(op.proc.pid), (
                "killed, but not by its failpoint"
            )
            after = creates()
            assert after > before, (
                f"incarnation {i} was killed at its create, but the audit log has no new one"
            )
            progress.append(f"create ({before} -> {after})")
        # 2. Running: each incarnation is SIGKILLed from outside right after it moved one more job to Running.
        for i in range(RUNNING_KILLS):
            before_running = running()
            if before_running == JOBS:
                break  # nothing left to move: the kills so far are reported below
            op.start()
            wait_for(
                lambda b=before_running: running() > b or None, 180, f"incarnation {i} to move a job", 0.1
            )
            op.kill()
            progress.append(f"running ({before_running} -> {running()})")
        op.start()  # unarmed: it must converge
        wait_for(lambda: running() == JOBS or None, 300, "every job Running")
        converged = time.monotonic() - t0
        time.sleep(5)  # a few more reconcile rounds (1 s apart): nothing may change any more
        sts = statuses()
        assert op.alive(), op.log_tail()
    finally:
        watch.stop()
        op.stop()
        print(f"--- operator log tail ---\n{op.log_tail(60)}")
        with rayjobs.RayJobsClient(ray_head.dashboard_url) as rj:
            for sid in sids.values():
                rj.stop(sid)
        for name in names:
            cluster.kubectl("delete", "rlhfjob", name, "-n", namespace, "--wait=false", check=False)
        for i in extra:
            cluster.kubectl("delete", "node", f"kwok-gpu-{i}", "--wait=false", check=False)
    print(
        f"\n{JOBS} jobs, operator SIGKILLed {len(progress)} times, each after progress of its own: "
        f"{', '.join(progress)}; all Running {converged:.0f}s after its first start"
    )
    # Every mid-create kill fired, each after its own create. The Running kills are as many as the race
    # allows (0 to RUNNING_KILLS, printed above): the stand-ins make Running quick, and one incarnation
    # may move every job left before the poller sees the first (a clean-clone run moved 8 -> 10 at once).
    assert sum(p.startswith("create") for p in progress) == MID_CREATE_KILLS, progress
    for name in names:
        st = sts[name]
        assert st.get("phase") == "Running", (name, st)
        assert st.get("restarts", 0) == 0, (name, st)
        assert st.get("submissionId") == sids[name], (name, st)
        # One RayCluster per job, ever: a second under the same name needs a delete first, and none was
        # asked for; one uid seen, never two at once; at most one successful create audited. (The create
        # in flight when an incarnation killed itself at its failpoint may be stored yet audited as a 504,
        # context canceled: then the job's successful creates are 0 and the object is the one uid.)
        created = audited_creates("rayclusters", namespace, name)
        assert len(created) <= 1, (name, [(e["stageTimestamp"], e["auditID"]) for e in created])
        assert not audited("delete", "rayclusters", namespace, name), name
        assert len(watch.uids[name]) == 1 and watch.max_at_once[name] == 1, (name, watch.uids[name])
        prefix = sids[name].rsplit("-", 1)[0] + "-"
        assert ray_submissions(prefix) == [sids[name]], f"{name}: the operator submitted a trainer of its own"


def test_a_raycluster_deleted_by_hand_is_recreated_with_a_warning(
    cluster: Cluster, namespace: str, operator: OperatorProcess, tiny_model: Path, tmp_path: Path
) -> None:
    """Policy (docs/reliability.md): the operator recreates the RayCluster, says so with a Warning Event
    `ClusterRecreated` and phase `Provisioning`, and the trainer goes on.

    Here every RayCluster's head is the one local Ray head, so the trainer's Ray job outlives the deleted
    cluster and the operator finds it again: the same submission, no second one. On a real cluster the
    new head has no job and the same attempt's id is submitted again (the trainer resumes from its
    checkpoint): `unit/test_status.py::test_a_running_jobs_lost_cluster_is_recreated_then_the_same_attempt_resubmitted`.
    """
    cluster.apply(tiny_job("orphan", tiny_model, tmp_path / "ckpt", steps=200, lean=True), namespace)
    try:

        def status() -> dict[str, Any]:
            return (cluster.get("rlhfjob", "orphan", namespace) or {}).get("status", {})

        wait_for(lambda: status().get("phase") == "Running" or None, 600, "the job Running")
        old = cluster.get("raycluster", "orphan", namespace)
        assert old is not None
        sid = status()["submissionId"]
        phases = PhaseWatch(cluster, "rlhfjob", "orphan", namespace)
        wait_for(lambda: phases.phases == ["Running"] or None, 30, "the phase watch started")
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
        wait_for(lambda: phases.phases[-2:] == ["Provisioning", "Running"] or None, 300, "Running again")
        recovered = time.monotonic() - t0
        seen = phases.stop()
        assert seen == ["Running", "Provisioning", "Running"], seen
        st = status()
        assert st.get("restarts", 0) == 0
        assert st["submissionId"] == sid
        assert ray_submissions(sid.rsplit("-", 1)[0] + "-") == [sid]
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
            doc["spec"].setdefault("pods", {})["env"] = [START_FAULT]
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
