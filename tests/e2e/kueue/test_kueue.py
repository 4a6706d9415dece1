"""RLHFJobs under a real Kueue (its controller manager and webhooks, `devcluster.py kueue-up`): quota,
preemption that loses little, no fight over the RayCluster, and a deadline that counts admitted time only.

Kueue manages each job's RayCluster (docs/kueue.md): it suspends the cluster at creation, admits it by
unsuspending it, evicts it by suspending it again. The pods are KWOK's and the trainer runs on the local
Ray head (the development override, the stand-in for a head pod). The quota test proves what the
operator and Kueue do with the jobs, not training: its three jobs run STAND-IN TRAINERS (a `sleep`
submitted as each job's Ray job before the operator can submit one, `submit_standin_trainer`), so it
starts no real trainer. The preemption test's low-priority job is the real trainer (its checkpoint on
eviction and its resume are the proof); the high-priority job that preempts it is a stand-in.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from testkit.support import (
    RAY_DASHBOARD_PORT,
    Cluster,
    OperatorProcess,
    condition,
    ray_job_logs,
    rollout_replicas,
    step_reports,
    submit_standin_trainer,
    tiny_job,
    wait_for,
)
from testkit.support import job_status as status

import devcluster

pytestmark = pytest.mark.kueue

ROOT = Path(__file__).resolve().parents[3]
QUEUE = "research"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
# The third job of the quota test queues QUEUED_S, longer than its deadline, then runs within it. Its
# trainer is a stand-in that sleeps STANDIN_S, so the deadline covers the admission, KWOK's pods, the
# submission and that sleep: seconds, not a real trainer's start-up (35-228 s measured on this machine).
# QUEUED_S also spans many of the test operator's 1 s rounds, in which it must write nothing Kueue owns.
# Seen admitted to Succeeded: 2.4-3.8 s (2026-11-29, printed below; 3.8 s beside an image build): the deadline
# leaves a loaded machine more than 3 times that.
QUEUED_S, DEADLINE_S, STANDIN_S = 17, 14, 5


def kueue_version(cluster: Cluster) -> str:
    """The Kueue API version this API server serves (v1beta2 from Kueue 0.15, else v1beta1)."""
    served = cluster.kubectl("api-versions").stdout.split()
    for v in ("kueue.x-k8s.io/v1beta2", "kueue.x-k8s.io/v1beta1"):
        if v in served:
            return v
    raise AssertionError(f"no Kueue API served: {[s for s in served if 'kueue' in s]}")


def job_gpus(doc: dict[str, Any], namespace: str) -> int:
    """GPUs the job's RayCluster asks for, as Kueue counts them (every pod of every group)."""
    from rlhf_api.spec import RLHFJob
    from rlhf_operator import manifests

    rc = manifests.build_raycluster(
        RLHFJob.model_validate({**doc, "metadata": {**doc["metadata"], "namespace": namespace}})
    )
    groups = [({"replicas": 1, **rc["spec"]["headGroupSpec"]})] + rc["spec"]["workerGroupSpecs"]
    total = 0
    for g in groups:
        limits = g["template"]["spec"]["containers"][0].get("resources", {}).get("limits", {})
        total += int(g.get("replicas", 1)) * int(limits.get("nvidia.com/gpu", 0))
    return total


def make_queue(cluster: Cluster, namespace: str, gpus: int, name: str) -> None:
    """A ResourceFlavor, a ClusterQueue with `gpus` nvidia.com/gpu that preempts lower priorities, and the
    LocalQueue `research` in `namespace`: the objects docs/kueue.md shows."""
    api = kueue_version(cluster)
    objs: list[dict[str, Any]] = [
        {"apiVersion": api, "kind": "ResourceFlavor", "metadata": {"name": "default-flavor"}},
        {
            "apiVersion": api,
            "kind": "ClusterQueue",
            "metadata": {"name": name},
            "spec": {
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
                "preemption": {"withinClusterQueue": "LowerPriority"},
                "resourceGroups": [
                    {
                        "coveredResources": ["cpu", "memory", "nvidia.com/gpu"],
                        "flavors": [
                            {
                                "name": "default-flavor",
                                "resources": [
                                    {"name": "cpu", "nominalQuota": 1000},
                                    {"name": "memory", "nominalQuota": "4000Gi"},
                                    {"name": "nvidia.com/gpu", "nominalQuota": gpus},
                                ],
                            }
                        ],
                    }
                ],
            },
        },
        {"apiVersion": api, "kind": "WorkloadPriorityClass", "metadata": {"name": "rlhf-low"}, "value": 100},
        {
            "apiVersion": api,
            "kind": "WorkloadPriorityClass",
            "metadata": {"name": "rlhf-high"},
            "value": 1000,
        },
    ]
    for obj in objs:
        cluster.apply(obj)
    cluster.apply(
        {
            "apiVersion": api,
            "kind": "LocalQueue",
            "metadata": {"name": QUEUE},
            "spec": {"clusterQueue": name},
        },
        namespace,
    )


def delete_queue(cluster: Cluster, name: str) -> None:
    cluster.kubectl("delete", "clusterqueue", name, "--wait=false", check=False)


def queued_tiny(
    name: str, model: Path, ckpt: Path, steps: int, priority: str | None = None, **spec: Any
) -> dict[str, Any]:
    doc = tiny_job(name, model, ckpt, steps, **spec)
    doc["metadata"]["labels"] = {QUEUE_LABEL: QUEUE, **({PRIORITY_LABEL: priority} if priority else {})}
    return doc


def phase_in(cluster: Cluster, namespace: str, name: str, *phases: str) -> dict[str, Any] | None:
    st = status(cluster, namespace, name)
    assert st.get("phase") != "Failed", f"{name} failed: {st}"
    return st if st.get("phase") in phases else None


def _events_named(cluster: Cluster, namespace: str, name: str) -> list[dict[str, Any]]:
    out = cluster.kubectl(
        "get", "events", "-n", namespace, "--field-selector", f"involvedObject.name={name}", "-o", "json"
    ).stdout
    items: list[dict[str, Any]] = json.loads(out)["items"]
    return items


def ray_job(submission_id: str) -> dict[str, Any]:
    resp = httpx.get(f"http://127.0.0.1:{RAY_DASHBOARD_PORT}/api/jobs/{submission_id}", timeout=10)
    resp.raise_for_status()
    info: dict[str, Any] = resp.json()
    return info


def _audited_writes_in_namespace(namespace: str, since: datetime, until: datetime) -> list[dict[str, Any]]:
    """Every write (create/update/patch/delete) the API server audited in `namespace` between the two
    times, with its user agent: the API server's own record, so nothing between two polls is missed."""
    parts = sorted((devcluster.STATE / "logs").glob("audit*.log"))
    assert parts, "no audit log: is this the dev cluster's kube-apiserver?"
    out = []
    for path in parts:
        with path.open(errors="replace") as f:
            for line in f:
                if f'"{namespace}"' not in line:
                    continue
                ev = json.loads(line)
                ref = ev.get("objectRef", {})
                if ev.get("stage") != "ResponseComplete" or ref.get("namespace") != namespace:
                    continue
                if ev.get("verb") not in ("create", "update", "patch", "delete"):
                    continue
                at = datetime.fromisoformat(str(ev["requestReceivedTimestamp"]).replace("Z", "+00:00"))
                if since <= at <= until:
                    out.append(ev)
    return out


def by_operator(ev: dict[str, Any]) -> bool:
    """The operator's requests: the Kubernetes Python client's and kopf's user agents (Kueue's and KubeRay's
    are Go clients)."""
    agent = str(ev.get("userAgent") or "")
    return agent.startswith(("OpenAPI-Generator", "kopf"))


def test_quota_admits_two_queues_the_third_with_kueues_reason_and_never_fights(
    kueue: Cluster, namespace: str, operator: OperatorProcess, tiny_model: Path, tmp_path: Path
) -> None:
    cluster = kueue
    holders = [queued_tiny(n, tiny_model, tmp_path / n, steps=200) for n in ("first", "second")]
    # The third queues far longer than its deadline; the deadline counts only from its admission.
    third = queued_tiny(
        "third", tiny_model, tmp_path / "third", steps=1, runPolicy={"activeDeadlineSeconds": DEADLINE_S}
    )
    per_job = job_gpus(third, namespace)
    assert per_job == job_gpus(holders[0], namespace) and per_job > 0
    sids: dict[str, str] = {}
    try:
        # The holders' stand-ins go in before their queue exists: until then Kueue admits nothing, so the
        # operator cannot have submitted a trainer of its own.
        for doc in holders:
            cluster.apply(doc, namespace)
            sids[doc["metadata"]["name"]] = submit_standin_trainer(
                cluster, namespace, doc["metadata"]["name"]
            )
        make_queue(cluster, namespace, 2 * per_job, f"cq-{namespace}")
        for doc in holders:
            wait_for(
                lambda d=doc: phase_in(cluster, namespace, d["metadata"]["name"], "Running"),
                300,
                f"{doc['metadata']['name']} Running",
            )
        # The example that carries the queue label, applied as written (namespace aside): Kueue takes it
        # into `research`, and with the quota held it waits there with Kueue's reason. (Before the third
        # job's window below: its creation writes a Secret and a NetworkPolicy.)
        example = yaml.safe_load((ROOT / "examples" / "rlhfjob-grpo.yaml").read_text())
        assert example["metadata"]["labels"][QUEUE_LABEL] == QUEUE
        cluster.apply(example, namespace)
        name = example["metadata"]["name"]
        st = wait_for(lambda: phase_in(cluster, namespace, name, "Queued"), 120, "the example Queued")
        assert "insufficient unused quota" in condition(st, "Queued").get("message", ""), st
        cluster.kubectl("delete", "rlhfjob", name, "-n", namespace)

        cluster.apply(third, namespace)
        sids["third"] = submit_standin_trainer(cluster, namespace, "third", f"sleep {STANDIN_S}")
        st = wait_for(lambda: phase_in(cluster, namespace, "third", "Queued"), 120, "third Queued")
        queued_at = datetime.now(UTC)
        cond = condition(st, "Queued")
        assert cond.get("status") == "True" and cond.get("reason") == "Pending", st
        assert "insufficient unused quota" in cond["message"] and "nvidia.com/gpu" in cond["message"], cond
        rc = cluster.get("raycluster", "third", namespace) or {}
        assert rc.get("spec", {}).get("suspend") is True, rc.get("spec", {}).get("suspend")

        # Our own scaling of an admitted job, in the window: Kueue made its cluster elastic (the devcluster
        # runs Kueue with ElasticJobsViaWorkloadSlices), so the operator scales the rollout group and the
        # extra engine waits for quota in a new Workload slice; nothing is evicted. The operator's patch of
        # first's RayCluster is also the window's positive control below.
        cluster.kubectl("scale", "rlhfjob", "first", "-n", namespace, "--replicas=2")
        wait_for(
            lambda: rollout_replicas(cluster, namespace, "first") == 2 or None,
            60,
            "first's rollout group at 2",
        )
        # QUEUED_S of a queued job: it stays Queued, and the operator writes nothing Kueue owns: not the
        # third's RayCluster (whose spec.suspend is Kueue's) and no Workload.
        deadline = time.monotonic() + QUEUED_S
        while time.monotonic() < deadline:
            assert status(cluster, namespace, "third").get("phase") == "Queued"
            time.sleep(5)
        until = datetime.now(UTC)
        writes = _audited_writes_in_namespace(namespace, queued_at, until)
        operator_writes = [ev for ev in writes if by_operator(ev)]
        kinds = Counter(
            "/".join(filter(None, (ev["objectRef"].get("resource"), ev["objectRef"].get("subresource"))))
            for ev in operator_writes
        )
        print(f"\naudit window {queued_at.isoformat()} to {until.isoformat()} in {namespace}: {len(writes)} "
              f"writes, the operator's by kind: {dict(kinds)}")  # fmt: skip
        # The positive control: in this same window the selector finds the operator's own write of first's
        # RayCluster (the scale above), a write to the very kind "no fight" is about, so that finding is
        # about writes that were seen, not an empty selection.
        cluster_writes = {
            (ev["verb"], ev["objectRef"].get("name"))
            for ev in operator_writes
            if (ev["objectRef"].get("resource"), ev["objectRef"].get("subresource")) == ("rayclusters", None)
        }
        assert any(n == "first" for _, n in cluster_writes), (
            f"the operator's scale of first's RayCluster is not in the audit window: {cluster_writes}",
            sorted({str(ev.get("userAgent")) for ev in writes}),
        )
        fights = [
            (ev["verb"], ev["objectRef"].get("resource"), ev["objectRef"].get("name"), ev.get("userAgent"))
            for ev in operator_writes
            if (
                ev["objectRef"].get("resource") == "workloads"
                or (ev["objectRef"].get("resource"), ev["objectRef"].get("name")) == ("rayclusters", "third")
            )
        ]
        assert not fights, f"the operator wrote objects Kueue owns fields of: {fights}"
        workloads = cluster.list("workloads", namespace)
        # The control of "no eviction": the listing holds the Workloads of all three jobs' RayClusters.
        owners = {ref.get("name") for w in workloads for ref in w["metadata"].get("ownerReferences", [])}
        assert {"first", "second", "third"} <= owners, owners
        evicted = [
            (w["metadata"]["name"], c.get("reason"))
            for w in workloads
            for c in w.get("status", {}).get("conditions", [])
            if c["type"] == "Evicted" and c["status"] == "True"
        ]
        assert not evicted, f"a Workload was evicted: {evicted}"
        assert phase_in(cluster, namespace, "first", "Running"), "first keeps running after its scale-up"
        assert not (cluster.get("raycluster", "first", namespace) or {})["spec"].get("suspend")
        # Every write of the operator in the window (non-empty: the control above) is to its own kinds.
        assert operator_writes and all(
            ev["objectRef"].get("resource") in ("rlhfjobs", "events", "rayclusters") for ev in operator_writes
        ), [(ev["verb"], ev["objectRef"]) for ev in operator_writes]

        # One holder deleted: the third is admitted, and runs to Succeeded although it queued for longer
        # than its activeDeadlineSeconds.
        cluster.kubectl("delete", "rlhfjob", "first", "-n", namespace, "--wait=false")
        wait_for(
            lambda: phase_in(cluster, namespace, "third", "Provisioning", "Running", "Succeeded"),
            180,
            "third admitted",
        )
        admitted = datetime.now(UTC)
        cluster.kubectl("delete", "rlhfjob", "second", "-n", namespace, "--wait=false")
        st = wait_for(
            lambda: phase_in(cluster, namespace, "third", "Succeeded"), 180, "third Succeeded", interval=1
        )
        print(f"third: admitted {(admitted - queued_at).total_seconds():.0f}s after it queued, Succeeded "
              f"{(datetime.now(UTC) - admitted).total_seconds():.1f}s after (deadline {DEADLINE_S}s)")  # fmt: skip
        assert (admitted - queued_at).total_seconds() > DEADLINE_S, (
            "the third queued longer than its deadline"
        )
        assert st["submissionId"] == sids["third"], (st["submissionId"], sids["third"])
        cond = condition(st, "Queued")
        assert (cond.get("status"), cond.get("reason")) == ("False", "Admitted"), st
        reasons = [e["reason"] for e in _events_named(cluster, namespace, "third")]
        assert "Queued" in reasons and "Admitted" in reasons, reasons
    finally:
        delete_queue(cluster, f"cq-{namespace}")
        for sid in sids.values():  # the holders' sleeping stand-ins, if their jobs' deletion left them
            try:
                httpx.post(f"http://127.0.0.1:{RAY_DASHBOARD_PORT}/api/jobs/{sid}/stop", timeout=10)
            except httpx.HTTPError as e:  # a head already gone: nothing left to stop, and the test's own
                print(f"stand-in {sid} not stopped: {e}")  # failure, if any, stays the one reported


def test_preemption_saves_a_checkpoint_and_the_job_resumes_from_it_when_readmitted(
    kueue: Cluster, namespace: str, operator: OperatorProcess, tiny_model: Path, tmp_path: Path
) -> None:
    cluster = kueue
    low = queued_tiny(
        "low",
        tiny_model,
        tmp_path / "low",
        steps=6,
        priority="rlhf-low",
        lean=True,
        runPolicy={"terminationGracePeriodSeconds": 120},  # an unmeasured save is taken as 60 s
    )
    low["spec"]["checkpoint"]["intervalSteps"] = 100  # no regular checkpoint: only the preemption's
    high = queued_tiny("high", tiny_model, tmp_path / "high", steps=2, priority="rlhf-high", lean=True)
    make_queue(cluster, namespace, job_gpus(low, namespace), f"cq-{namespace}")
    try:
        cluster.apply(low, namespace)
        st = wait_for(
            lambda: (
                (s := phase_in(cluster, namespace, "low", "Running")) and int(s.get("step") or 0) >= 2 and s
            ),
            900,
            "low Running past step 2",
            interval=1,
        )
        stopped_sid = st["submissionId"]
        cluster.apply(high, namespace)
        # High's trainer is a stand-in (it preempts; its training proves nothing here): submitted at
        # once, while Kueue is still evicting low, before high's cluster can be admitted and ready.
        submit_standin_trainer(cluster, namespace, "high", f"sleep {STANDIN_S}")

        st = wait_for(lambda: phase_in(cluster, namespace, "low", "Queued"), 120, "low evicted and Queued")
        assert condition(st, "Queued").get("reason") == "Preempted", st
        assert st["preemptions"] == 1 and int(st.get("restarts") or 0) == 0, st
        assert any(
            e["reason"] == "Preempted" and e["type"] == "Warning"
            for e in _events_named(cluster, namespace, "low")
        )
        # Its pods go (KubeRay deletes them for the suspended cluster); its trainer stops at a step
        # boundary with a checkpoint of that step.
        wait_for(
            lambda: not cluster.list("pods", namespace, "ray.io/cluster=low") or None, 120, "low's pods gone"
        )
        wait_for(
            lambda: ray_job(stopped_sid)["status"] in ("STOPPED", "FAILED") or None,
            120,
            "low's trainer stopped",
        )
        logs = ray_job_logs(stopped_sid)
        saved = [ln for ln in logs.splitlines() if ln.startswith("preempted: saved checkpoint at step")]
        assert saved, f"no preemption checkpoint in the driver's log:\n{logs[-3000:]}"
        saved_step = int(saved[-1].split("at step ")[1].split()[0])
        trained_before = max(r["step"] for r in step_reports(logs))
        assert saved_step == trained_before >= 2, (saved_step, trained_before)
        # The checkpoint the readmitted attempt resumes from: committed (its state file is written last,
        # then the directory renamed) and of the saved step.
        state_file = tmp_path / "low" / f"step-{saved_step:08d}" / "trainer_state.json"
        assert state_file.exists(), sorted(p.name for p in (tmp_path / "low").iterdir())
        state = json.loads(state_file.read_text())
        assert state["complete"] is True and state["step"] == saved_step, {
            k: state.get(k) for k in ("complete", "step", "data")
        }

        # The higher priority runs; then the low one is readmitted, resumes from its checkpoint and ends.
        wait_for(lambda: phase_in(cluster, namespace, "high", "Succeeded"), 600, "high Succeeded", interval=2)
        st = wait_for(
            lambda: phase_in(cluster, namespace, "low", "Succeeded"), 900, "low Succeeded", interval=2
        )
        resumed_sid = st["submissionId"]
        assert resumed_sid != stopped_sid
        steps = [r["step"] for r in step_reports(ray_job_logs(resumed_sid))]
        assert steps and steps[0] == saved_step + 1 and steps[-1] == 6, steps
        print(f"preemption: saved at step {saved_step}, resumed at {steps[0]}: 0 steps lost")
        assert st["preemptions"] == 1 and int(st.get("restarts") or 0) == 0, st
    finally:
        delete_queue(cluster, f"cq-{namespace}")
