"""benchmarks/operator_scale: the API server's floor (`api_floor_s`), the burst's creates sent as
RayClusters straight to the API server. Pure parts only; the benchmark itself runs the real thing."""

from __future__ import annotations

from typing import Any

import pytest
from operator_scale import phases

pytestmark = pytest.mark.unit


class RecordingCustomObjects:
    """A stand-in for the Kubernetes client's CustomObjectsApi: holds one RayCluster, records creates."""

    def __init__(self, items: list[dict[str, Any]]) -> None:
        self.items, self.created = items, []  # type: ignore[var-annotated]

    def list_namespaced_custom_object(self, group: str, version: str, ns: str, plural: str) -> dict[str, Any]:
        assert (group, plural) == ("ray.io", "rayclusters")
        return {"items": self.items}

    def create_namespaced_custom_object(
        self, group: str, version: str, ns: str, plural: str, body: Any
    ) -> None:
        self.created.append((ns, body))


OPERATORS = {
    "apiVersion": "ray.io/v1",
    "kind": "RayCluster",
    "metadata": {
        "name": "rlhf-x",
        "namespace": "bench-solo",
        "uid": "u1",
        "resourceVersion": "7",
        "labels": {"rlhf.dev/job": "solo-0"},
        "ownerReferences": [{"kind": "RLHFJob", "name": "solo-0"}],
    },
    "spec": {"rayVersion": "2.x", "headGroupSpec": {}},
    "status": {"state": "ready"},
}


def test_the_floor_copies_the_operators_raycluster_suspended_unowned_and_unlabelled() -> None:
    body = phases.floor_body(RecordingCustomObjects([OPERATORS]), "bench-solo")
    assert body["spec"] == {**OPERATORS["spec"], "suspend": True}
    assert body["metadata"] == {"labels": {"bench": "floor"}}
    assert "status" not in body


def test_the_floor_creates_as_many_clusters_each_timed_and_totals_first_post_to_last_answer() -> None:
    api = RecordingCustomObjects([OPERATORS])
    floor = phases.api_floor(api, phases.floor_body(api, "bench-solo"), 12, 0, 4)
    names = sorted(body["metadata"]["name"] for _, body in api.created)
    assert names == [f"floor-{i:03d}" for i in range(12)]
    assert {ns for ns, _ in api.created} == {phases.FLOOR_NS}
    assert set(floor.answered) == set(floor.started) == set(names)
    assert floor.total_s() == max(floor.answered.values()) - min(floor.started.values()) >= 0
    assert all(x >= 0 for x in floor.latencies()) and len(floor.latencies()) == 12


def test_no_answer_is_no_floor() -> None:
    assert phases.Floor().total_s() != phases.Floor().total_s()  # NaN: reported as null, never 0
    with pytest.raises(RuntimeError, match="no RayCluster in bench-solo"):
        phases.floor_body(RecordingCustomObjects([]), "bench-solo")
