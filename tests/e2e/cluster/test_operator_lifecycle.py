"""The operator against the real control plane: RayCluster creation, phases, restarts, suspend, TTL, delete.

The trainer runs on the local Ray head (the dev override maps every RayCluster head to it). Jobs here
arm the trainer's `start@0` fault (rlhf_trainer.faults), so the real trainer entrypoint fails fast,
exiting 1 like a crash: that is the failure path the operator must handle (restarts, backoff, TTL)
without minutes of training. Bad input the trainer finds at run time (exit 2) is the other path: Failed
at once, no restart.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from testkit import support
from testkit.support import (
    Cluster,
    OperatorProcess,
    audited_creates,
    events,
    failing_job,
    phase_is,
    ray_submissions,
    wait_for,
)

pytestmark = pytest.mark.cluster
ROOT = Path(__file__).resolve().parents[3]


def test_job_gets_an_owned_raycluster_with_running_pods(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    cluster.apply(
        support.example_job("tiny", **{"metadata.labels": {"kueue.x-k8s.io/queue-name": "q1"}}), namespace
    )
    job = cluster.get("rlhfjob", "tiny", namespace)
    assert job is not None
    rc = wait_for(lambda: cluster.get("raycluster", "tiny", namespace), 30, "the RayCluster")
    owner = rc["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"], owner["uid"]) == ("RLHFJob", "tiny", job["metadata"]["uid"])
    assert rc["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "q1"
    groups = {g["groupName"]: g for g in rc["spec"]["workerGroupSpecs"]}
    assert set(groups) == {"trainer", "rollout"}
    assert groups["rollout"]["replicas"] == 1

    pods = wait_for(
        lambda: (
            (p := cluster.list("pods", namespace, selector="ray.io/cluster=tiny"))
            and len(p) == 1 + groups["trainer"]["replicas"] + 1
            and all(x["status"].get("phase") == "Running" for x in p)
            and p
        ),
        90,
        "head, trainer and rollout pods Running",
    )
    assert all(p["spec"]["nodeName"].startswith("kwok-gpu-") for p in pods)
    assert all(p["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "q1" for p in pods)
    st = wait_for(
        lambda: phase_is(cluster, namespace, "tiny", "Provisioning", "Running", "Restarting", "Failed"),
        60,
        "the job to leave Pending",
    )
    assert st["rayClusterName"] == "tiny"

    out = cluster.kubectl("get", "rlhf", "-n", namespace).stdout
    header = out.splitlines()[0].split()
    for column in ("NAME", "PHASE", "STEP", "GENSHARE", "ENGINES", "AGE"):
        assert column in header, out


def test_failed_trainer_is_restarted_up_to_backoff_limit(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    cluster.apply(failing_job("flaky", **{"spec.runPolicy.backoffLimit": 2}), namespace)
    st = wait_for(
        lambda: phase_is(cluster, namespace, "flaky", "Failed"), 240, "the job to fail after its retries"
    )
    assert st["restarts"] == 2
    assert "backoffLimit 2 reached" in st["message"]
    # One Restarting Event per restart (the API server folds repeats into one Event's count).
    restarting = [
        e.get("count") or 1 for e in events(cluster, namespace, "flaky") if e["reason"] == "Restarting"
    ]
    assert sum(restarting) == st["restarts"], restarting
    job = cluster.get("rlhfjob", "flaky", namespace)
    assert job is not None
    uid = job["metadata"]["uid"][:8]
    submitted = ray_submissions(f"rlhf-{namespace}-flaky-{uid}-")
    assert sorted(submitted) == sorted(f"rlhf-{namespace}-flaky-{uid}-{i}" for i in range(3)), submitted
    # A finished job releases its GPUs.
    wait_for(
        lambda: cluster.get("raycluster", "flaky", namespace) is None or None, 60, "the RayCluster deleted"
    )


def test_bad_input_found_by_the_trainer_fails_the_job_at_once_naming_it(
    cluster: Cluster, namespace: str, operator: OperatorProcess, tiny_model: Path, tmp_path: Path
) -> None:
    """A reward function that does not import passes admission (the image's modules are not known
    there); the trainer exits 2 naming it, and retrying could only fail the same way. (The model and the
    prompts exist, so the reward is what the trainer refuses.)"""
    bad = support.tiny_job(
        "typo", tiny_model, tmp_path / "ckpt", steps=2, lean=True, runPolicy={"backoffLimit": 3}
    )
    bad["spec"]["model"]["reward"]["function"] = "rlhf_no_such_module:reward"
    cluster.apply(bad, namespace)
    st = wait_for(
        lambda: phase_is(cluster, namespace, "typo", "Failed", "Restarting"), 180, "the job to fail"
    )
    assert st["phase"] == "Failed", st
    assert st.get("restarts", 0) == 0, st
    assert "rlhf_no_such_module" in st["message"] and "not restarted" in st["message"], st["message"]
    failed = next(c for c in st["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "InvalidInput", failed
    warned = [e for e in events(cluster, namespace, "typo") if e["type"] == "Warning"]
    assert any("rlhf_no_such_module" in e["message"] for e in warned), warned
    job = cluster.get("rlhfjob", "typo", namespace)
    assert job is not None
    uid = job["metadata"]["uid"][:8]
    assert ray_submissions(f"rlhf-{namespace}-typo-{uid}-") == [f"rlhf-{namespace}-typo-{uid}-0"]


def test_a_rank_promised_a_gpu_that_sees_none_fails_the_job_naming_its_pod_without_restarts(
    cluster: Cluster, namespace: str, operator: OperatorProcess, tiny_model: Path, tmp_path: Path
) -> None:
    """The job opts out of the operator's CPU stand-in (RLHF_GPU_STANDIN=cpu): its processes compute on
    the GPUs its pods asked for. Ray gives each rank a whole logical GPU, and no CUDA device exists here:
    the first rank to look fails the job as bad input, naming itself, its pod and what it saw, once."""
    job = support.tiny_job(
        "nogpu", tiny_model, tmp_path / "ckpt", steps=2, lean=True, runPolicy={"backoffLimit": 3}
    )
    job["spec"]["pods"] = {"env": [{"name": "RLHF_GPU_STANDIN", "value": ""}]}
    cluster.apply(job, namespace)
    st = wait_for(
        lambda: phase_is(cluster, namespace, "nogpu", "Failed", "Restarting"), 300, "the job to fail"
    )
    assert st["phase"] == "Failed", st
    assert st.get("restarts", 0) == 0, st
    message = st["message"]
    assert "was promised 1 GPU(s)" in message and "sees 0 CUDA device(s)" in message, message
    assert " on pod " in message and ("rank" in message or "engine" in message), message
    failed = next(c for c in st["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "InvalidInput", failed
    job_obj = cluster.get("rlhfjob", "nogpu", namespace)
    assert job_obj is not None
    uid = job_obj["metadata"]["uid"][:8]
    assert ray_submissions(f"rlhf-{namespace}-nogpu-{uid}-") == [f"rlhf-{namespace}-nogpu-{uid}-0"]


def test_ttl_after_finished_deletes_the_job(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    cluster.apply(
        failing_job(
            "short", **{"spec.runPolicy.backoffLimit": 0, "spec.runPolicy.ttlSecondsAfterFinished": 3}
        ),
        namespace,
    )
    wait_for(lambda: phase_is(cluster, namespace, "short", "Failed"), 180, "the job to fail")
    t0 = time.monotonic()
    wait_for(lambda: cluster.get("rlhfjob", "short", namespace) is None or None, 60, "TTL deletion")
    assert time.monotonic() - t0 >= 1.0


def test_suspend_releases_pods_and_resume_brings_them_back(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    cluster.apply(failing_job("pausable", **{"spec.runPolicy.suspend": True}), namespace)
    st = wait_for(lambda: phase_is(cluster, namespace, "pausable", "Suspended"), 60, "Suspended")
    assert "suspend" in st["message"]
    rc = wait_for(lambda: cluster.get("raycluster", "pausable", namespace), 30, "the RayCluster")
    assert rc["spec"]["suspend"] is True
    wait_for(
        lambda: not cluster.list("pods", namespace, selector="ray.io/cluster=pausable") or None, 60, "no pods"
    )

    cluster.kubectl(
        "patch",
        "rlhfjob",
        "pausable",
        "-n",
        namespace,
        "--type=merge",
        "-p",
        json.dumps({"spec": {"runPolicy": {"suspend": False}}}),
    )
    wait_for(
        lambda: (
            (cluster.get("raycluster", "pausable", namespace) or {}).get("spec", {}).get("suspend") is False
            or None
        ),
        30,
        "the RayCluster resumed",
    )
    wait_for(
        lambda: len(cluster.list("pods", namespace, selector="ray.io/cluster=pausable")) >= 3 or None,
        90,
        "pods back after resume",
    )
    wait_for(
        lambda: phase_is(cluster, namespace, "pausable", "Provisioning", "Running", "Restarting", "Failed"),
        120,
        "the job to leave Suspended",
    )


def test_deleting_the_job_deletes_everything(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    cluster.apply(failing_job("doomed", **{"spec.runPolicy.suspend": True}), namespace)
    wait_for(lambda: cluster.get("raycluster", "doomed", namespace), 30, "the RayCluster")
    cluster.kubectl("delete", "rlhfjob", "doomed", "-n", namespace, "--wait=true", timeout=60)
    wait_for(lambda: cluster.get("raycluster", "doomed", namespace) is None or None, 60, "RayCluster GC")
    wait_for(
        lambda: not cluster.list("pods", namespace, selector="ray.io/cluster=doomed") or None, 60, "pod GC"
    )


@pytest.mark.parametrize(
    "point",
    [
        "after_cluster_create",
        "before_submit",
        "after_submit",
        "after_restart_decision",
        "before_status_patch",
    ],
)
def test_operator_killed_at_a_reconcile_point_converges(
    cluster: Cluster, namespace: str, operator: OperatorProcess, tmp_path: Path, point: str
) -> None:
    operator.stop()
    operator.start(RLHF_FAILPOINTS=point, RLHF_FAILPOINTS_DIR=str(tmp_path / "fp"))
    cluster.apply(failing_job("crashy", **{"spec.runPolicy.backoffLimit": 1}), namespace)
    wait_for(
        lambda: ((tmp_path / "fp" / point).exists() and not operator.alive()) or None,
        180,
        f"the operator to die at {point}",
    )
    operator.start()  # no failpoint armed: the restarted operator must converge
    st = wait_for(
        lambda: phase_is(cluster, namespace, "crashy", "Failed"), 240, "the job to converge to Failed"
    )
    assert st["restarts"] == 1
    # Exactly one RayCluster for the job's whole life, from the API server's own record of creates (the
    # cluster is deleted once the job has failed, so listing it now would prove nothing).
    created = audited_creates("rayclusters", namespace, "crashy")
    assert len(created) == 1, [(e["stageTimestamp"], e["auditID"]) for e in created]
    job = cluster.get("rlhfjob", "crashy", namespace)
    assert job is not None
    uid = job["metadata"]["uid"][:8]
    # Its Secret and NetworkPolicy, which follow the RayCluster: made once each, also when the kill came
    # between the RayCluster and them (the restarted operator's round makes them: JobState.security_due).
    assert len(audited_creates("networkpolicies", namespace, "crashy")) == 1
    assert len(audited_creates("secrets", namespace, f"crashy-ray-token-{uid}")) == 1
    submitted = ray_submissions(f"rlhf-{namespace}-crashy-{uid}-")
    assert sorted(submitted) == [f"rlhf-{namespace}-crashy-{uid}-0", f"rlhf-{namespace}-crashy-{uid}-1"], (
        submitted
    )
