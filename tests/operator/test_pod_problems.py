"""pod_problems.slim_pod: the operator's cached pods keep exactly what the pod diagnosis and the engine
plan read, so both answer the same on the slim pod as on the whole one."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from rlhf_operator import model_fetch
from rlhf_operator.pod_problems import diagnose, slim_pod
from rlhf_operator.scaling import engines_pending

pytestmark = pytest.mark.unit


def whole_pod(
    name: str, phase: str, *, unschedulable: str = "", waiting: str = "", deleting: bool = False
) -> dict[str, Any]:
    """A pod as the API server returns it (KWOK's and the kubelet's fields included)."""
    conditions = [
        {
            "type": "Initialized",
            "status": "True",
            "lastProbeTime": None,
            "lastTransitionTime": "2026-11-26T05:00:00Z",
        },
        {
            "type": "PodScheduled",
            "status": "True",
            "lastProbeTime": None,
            "lastTransitionTime": "2026-11-26T05:00:00Z",
        },
    ]
    if unschedulable:
        conditions[1] = {
            "type": "PodScheduled",
            "status": "False",
            "reason": "Unschedulable",
            "message": unschedulable,
            "lastProbeTime": None,
            "lastTransitionTime": "2026-11-26T05:00:01Z",
        }
    state: dict[str, Any] = {"running": {"startedAt": "2026-11-26T05:00:02Z"}}
    if waiting:
        state = {"waiting": {"reason": waiting, "message": f"{waiting}: back-off pulling image"}}
    meta: dict[str, Any] = {
        "name": name,
        "namespace": "research",
        "uid": "0b9e",
        "resourceVersion": "812",
        "labels": {"ray.io/cluster": "tiny", "rlhf.dev/job": "tiny", "rlhf.dev/role": "rollout"},
        "ownerReferences": [{"kind": "RayCluster", "name": "tiny", "uid": "77"}],
        "managedFields": [{"manager": "kwok", "fieldsV1": {"f:status": {"f:phase": {}}}}],
    }
    if deleting:
        meta["deletionTimestamp"] = "2026-11-26T05:01:00Z"
    return {
        "metadata": meta,
        "spec": {"containers": [{"name": "ray-worker", "image": "trainer:1", "args": ["ray start"]}]},
        "status": {
            "phase": phase,
            "conditions": conditions,
            "hostIP": "10.0.0.7",
            "podIP": "10.1.0.9",
            "podIPs": [{"ip": "10.1.0.9"}],
            "qosClass": "Guaranteed",
            "startTime": "2026-11-26T05:00:00Z",
            "initContainerStatuses": [
                {
                    "name": "wait-gcs",
                    "ready": True,
                    "restartCount": 0,
                    "state": {"terminated": {"exitCode": 0}},
                }
            ],
            "containerStatuses": [
                {
                    "name": "ray-worker",
                    "image": "trainer:1",
                    "imageID": "sha256:abc",
                    "ready": not waiting,
                    "restartCount": 3,
                    "started": not waiting,
                    "state": state,
                    "lastState": {"terminated": {"exitCode": 1, "reason": "Error"}},
                }
            ],
        },
    }


UNSCHED = "0/1000 nodes are available: 1000 Insufficient nvidia.com/gpu."
PODS = [
    whole_pod("tiny-rollout-a", "Running"),
    whole_pod("tiny-rollout-b", "Pending", unschedulable=UNSCHED),
    whole_pod("tiny-rollout-c", "Pending", waiting="ImagePullBackOff"),
    whole_pod("tiny-rollout-d", "Pending", unschedulable=UNSCHED, deleting=True),
]


@pytest.mark.parametrize("pods", [PODS, PODS[:2], PODS[1:2], PODS[3:], PODS[:1], []])
def test_the_diagnosis_and_the_engine_plan_read_the_same_from_the_slim_pods(
    pods: list[dict[str, Any]],
) -> None:
    slim = [slim_pod(p) for p in pods]
    assert diagnose(slim) == diagnose(pods)
    assert engines_pending(slim, 2, 4) == engines_pending(pods, 2, 4)


def test_a_slim_pod_keeps_the_identity_and_the_problems_only() -> None:
    pod = whole_pod("tiny-rollout-c", "Pending", waiting="ImagePullBackOff", deleting=True)
    before = copy.deepcopy(pod)
    slim = slim_pod(pod)
    assert pod == before  # the watched body is not changed
    assert slim["metadata"] == {
        "name": "tiny-rollout-c",
        "namespace": "research",
        "labels": pod["metadata"]["labels"],
        "deletionTimestamp": "2026-11-26T05:01:00Z",
    }
    assert slim["status"] == {
        "phase": "Pending",
        "conditions": [{"type": "Initialized", "status": "True"}, {"type": "PodScheduled", "status": "True"}],
        "initContainerStatuses": [{"name": "wait-gcs"}],
        "containerStatuses": [
            {
                "name": "ray-worker",
                "state": {
                    "waiting": {
                        "reason": "ImagePullBackOff",
                        "message": "ImagePullBackOff: back-off pulling image",
                    }
                },
            }
        ],
    }
    assert slim_pod({"metadata": {"name": "x"}}) == {
        "metadata": {"name": "x", "namespace": None, "labels": {}, "deletionTimestamp": None},
        "status": {"phase": None},
    }


def test_a_slim_head_pod_keeps_its_fetch_step_as_models_ready_reads_it() -> None:
    """The operator reads the fetch-models step from its pod cache: a slimmed head pod must give the same
    ModelsReady as the whole pod, running, done with its bytes, and failed before a restart."""
    done = {
        "terminated": {"exitCode": 0, "message": '{"bytesFetched": 9, "bytesTotal": 9}', "startedAt": "t"}
    }
    failed = {"terminated": {"exitCode": 2, "message": '{"reason": "ModelNotFound", "message": "gone"}'}}
    for state, last in (
        ({"running": {"startedAt": "t"}}, {}),
        (done, {}),
        ({"waiting": {"reason": "CrashLoopBackOff"}}, failed),
    ):
        head = {
            "metadata": {"name": "tiny-head-x", "labels": {"ray.io/node-type": "head"}},
            "status": {
                "phase": "Pending",
                "initContainerStatuses": [
                    {"name": "fetch-models", "state": state, "lastState": last, "ready": False}
                ],
            },
        }
        whole = model_fetch.fetch_state([head], None)
        assert whole is not None and whole.phase != "waiting"
        assert model_fetch.fetch_state([slim_pod(head)], None) == whole
