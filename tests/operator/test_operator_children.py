"""The order of a job's creates (children.create_cluster, issue 38 item 5): with a token, the RayCluster's POST
is the first request, the NetworkPolicy and then the Secret follow it off the handler's thread, and a
reconcile round makes what a failed background creation left unmade. The API server is faked at the two
calls children makes (the RayCluster's POST, one security object's create), each recorded in order."""

from __future__ import annotations

import threading
import time
from typing import Any

import kopf
import pytest
from rlhf_api.spec import RLHFJob
from rlhf_operator import cache, children, job_state, kube, runtime
from testkit import status_inputs

pytestmark = pytest.mark.unit

TINY_DOC = status_inputs.job().model_dump(by_alias=True, exclude_none=True, mode="json")


def _job_and_body(phase: str | None = None, **security: str) -> tuple[RLHFJob, kopf.Body]:
    """The tiny job (its `spec.security` set as given, its phase `phase`) and its body as kopf hands it over."""
    doc = {**TINY_DOC, "spec": {**TINY_DOC["spec"], "security": security}}
    doc["status"] = {"phase": phase} if phase else {}
    return RLHFJob.model_validate(doc), kopf.Body(doc)


class _Server:
    """Records each create as (kind, thread name); a security object's create waits for `release` (the
    test's stand-in for a slow API server) and fails with `refuse` when set."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.release = threading.Event()
        self.release.set()
        self.refuse: int | None = None

    def create_namespaced_custom_object(self, *args: Any) -> dict[str, Any]:
        self.calls.append(("RayCluster", threading.current_thread().name))
        manifest: dict[str, Any] = args[-1]
        return {**manifest, "metadata": {**manifest["metadata"], "resourceVersion": "7", "uid": "c"}}

    def create_security_object(self, namespace: str, obj: dict[str, Any]) -> None:
        assert self.release.wait(10)
        if self.refuse is not None:
            raise children.ClusterRefused(self.refuse, f"{obj['kind']}: forbidden")
        self.calls.append((obj["kind"], threading.current_thread().name))

    def kinds(self) -> list[str]:
        return [kind for kind, _ in self.calls]


@pytest.fixture
def fake_api(monkeypatch: pytest.MonkeyPatch) -> _Server:
    fake = _Server()
    monkeypatch.setattr(runtime, "JOBS", job_state.JobStates())
    monkeypatch.setattr(cache, "_cluster_index", {})
    monkeypatch.setattr(kube, "custom", lambda: fake)
    monkeypatch.setattr(children, "_create_security_object", fake.create_security_object)
    monkeypatch.setattr(kopf, "event", lambda *a, **k: None)
    return fake


def _settled(body: kopf.Body) -> job_state.JobState:
    state = runtime.state_of(body)
    deadline = time.monotonic() + 10
    while state.security == "creating" and time.monotonic() < deadline:
        time.sleep(0.01)
    return state


def test_with_a_token_the_raycluster_is_the_first_request_and_the_policy_precedes_the_secret(
    fake_api: _Server,
) -> None:
    job, body = _job_and_body()
    fake_api.release.clear()  # the security objects' creates hang until released
    children.create_cluster(body, job)
    assert fake_api.kinds() == ["RayCluster"], "create_cluster returned before the security objects' creates"
    assert runtime.state_of(body).security == "creating"
    fake_api.release.set()
    assert _settled(body).security == "made"
    assert fake_api.kinds() == ["RayCluster", "NetworkPolicy", "Secret"]
    handler = threading.current_thread().name
    assert all(thread != handler for kind, thread in fake_api.calls[1:]), fake_api.calls


def test_without_a_token_the_policy_is_made_before_the_raycluster(fake_api: _Server) -> None:
    job, body = _job_and_body(rayAuthentication="Disabled")
    children.create_cluster(body, job)
    assert fake_api.kinds() == ["NetworkPolicy", "RayCluster"]
    assert runtime.state_of(body).security == "made"


def test_a_failed_background_create_is_made_by_the_next_round_and_a_refusal_raised(fake_api: _Server) -> None:
    job, body = _job_and_body("Provisioning")
    fake_api.refuse = 403
    children.create_cluster(body, job)
    assert _settled(body).security == "unmade"
    cluster = cache.get_cluster(body, job.name)
    assert cluster is not None
    with pytest.raises(children.ClusterRefused, match="NetworkPolicy: forbidden"):
        children.settle_security_objects(body, job, cluster)
    fake_api.refuse = None
    children.settle_security_objects(body, job, cluster)
    assert fake_api.kinds() == ["RayCluster", "NetworkPolicy", "Secret"]
    assert runtime.state_of(body).security == "made"
    children.settle_security_objects(body, job, cluster)  # once per job and process
    assert fake_api.kinds() == ["RayCluster", "NetworkPolicy", "Secret"]


@pytest.mark.parametrize(
    ("security", "cluster_exists", "phase", "due"),
    [
        ("unmade", True, "Provisioning", True),
        ("unmade", True, "Running", True),
        ("unmade", False, "Provisioning", False),  # the cluster's creation makes them
        ("creating", True, "Provisioning", False),  # under way in the background
        ("made", True, "Running", False),
        ("unmade", True, "Succeeded", False),
        ("unmade", True, "Failed", False),
    ],
)
def test_a_round_makes_the_security_objects_only_when_nothing_else_does(
    security: job_state.SecurityObjects, cluster_exists: bool, phase: str, due: bool
) -> None:
    state = job_state.JobState(security=security)
    assert state.security_due(cluster_exists, phase) is due
