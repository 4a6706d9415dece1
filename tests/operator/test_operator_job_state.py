"""Nothing the operator keeps per job outlives the job (issue 38, item 2): 1,000 jobs get every part of
their in-memory state through the handlers' own functions (the create path, a refused create, a RayCluster
patch, a scrape, a Jobs API client), are deleted through the watch's DELETED event, and then nothing is left:
the registry is empty, each Ray client is closed, and no module of the operator holds a table that grew
with the jobs."""

from __future__ import annotations

import copy
import dataclasses
import sys
from typing import Any

import kopf
import pytest
from rlhf_operator import (
    cache,
    children,
    handlers,
    job_state,
    kube,
    observe,
    rayjobs,
    runtime,
    runtimes,
    scrape,
)
from testkit import status_inputs

pytestmark = pytest.mark.unit

JOBS = 1000
TINY = status_inputs.job()
TINY_DOC = TINY.model_dump(by_alias=True, exclude_none=True, mode="json")


def _body(i: int) -> kopf.Body:
    doc = copy.deepcopy(TINY_DOC)
    doc.pop("status", None)
    doc["metadata"].update(name=f"job-{i}", namespace=f"ns{i % 7}", uid=f"uid-{i}", resourceVersion="1")
    doc["spec"]["runtimeRef"] = {"kind": "ClusterRLHFRuntime", "name": "dev"}  # bound once: JobState.runtime
    return kopf.Body(doc)


# A runtime that lets the job keep every field and gives it a per-job checkpoint claim.
RUNTIME = {
    "metadata": {"name": "dev", "generation": 2},
    "spec": {
        "overridable": [*TINY_DOC["spec"]],
        "storage": {"checkpoints": {"mountPath": "/ckpt", "claimTemplate": {"size": "1Gi"}}},
    },
}


class _FakeCustomObjects:
    """The CustomObjectsApi calls the create and patch paths make, answered as the API server would."""

    def create_namespaced_custom_object(self, *args: Any) -> dict[str, Any]:
        manifest: dict[str, Any] = args[-1]
        return {**manifest, "metadata": {**manifest["metadata"], "resourceVersion": "7", "uid": "c"}}

    def patch_namespaced_custom_object(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return {}


class _FakeRayJobs:
    closed = 0

    def __init__(self, url: str, token: str, keepalive: float) -> None:
        assert keepalive == runtime.CONFIG.head_keepalive  # its connection kept between rounds
        self.url = url

    def get(self, sid: str) -> rayjobs.RayJobInfo:
        return rayjobs.RayJobInfo(sid, rayjobs.RUNNING, "", None, None)

    def close(self) -> None:
        _FakeRayJobs.closed += 1


class _FakeScrapeClient:
    closed = 0

    def __init__(self, keepalive: float) -> None:
        assert keepalive == runtime.CONFIG.head_keepalive

    def close(self) -> None:
        _FakeScrapeClient.closed += 1


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """The handlers' helpers with the API server, the Ray heads and kopf's event poster faked."""
    monkeypatch.setattr(runtime, "JOBS", job_state.JobStates())
    monkeypatch.setattr(cache, "_cluster_index", {})  # the watch has delivered no RayCluster yet
    monkeypatch.setattr(kube, "custom", _FakeCustomObjects)
    monkeypatch.setattr(children, "_create_security_object", lambda namespace, obj: None)
    monkeypatch.setattr(observe, "ray_token", lambda body: f"token-{body.metadata.uid}")
    monkeypatch.setattr(kopf, "event", lambda *a, **k: None)
    monkeypatch.setattr(rayjobs, "RayJobsClient", _FakeRayJobs)
    monkeypatch.setattr(scrape, "fetch_metrics", lambda url, name, http: None)
    monkeypatch.setattr(scrape, "client", _FakeScrapeClient)
    monkeypatch.setattr(handlers, "_stopped", {})
    monkeypatch.setattr(runtimes, "_read_snapshot", lambda namespace, job, uid: None)
    monkeypatch.setattr(runtimes, "_read_runtime", lambda namespace, kind, name: RUNTIME)
    monkeypatch.setattr(runtimes, "_write_snapshot", lambda body, namespace, job, bound: None)
    monkeypatch.setattr(runtimes, "_create_claim", lambda namespace, claim: True)
    _FakeRayJobs.closed = _FakeScrapeClient.closed = 0


def _give_state(i: int) -> None:
    """Every part of job i's state, each through the function a handler calls."""
    body, job = _body(i), TINY
    handlers.ensure_cluster(body, kopf.Patch())  # parse, security objects, create, first status write
    children.refused(body, kopf.Patch(), job, children.ClusterRefused(503, "etcd is busy"))  # backoff
    cluster = cache.get_cluster(body, "tiny")
    assert cluster is not None, "the cluster just created is seen before the watch delivers it"
    children.patch_raycluster(body, cluster, {"spec": {"suspend": False}})
    observed = observe.ray_job_and_metrics(body, job, cluster, f"sid-{i}")  # Ray client, scrape client
    assert observed["ray_job"].status == rayjobs.RUNNING


def _module_tables() -> dict[str, int]:
    """The size of every dict, set or list at the top of an operator module."""
    sizes = {}
    for mod_name, mod in list(sys.modules.items()):
        if not mod_name.startswith("rlhf_operator"):
            continue
        for attr, value in vars(mod).items():
            if isinstance(value, dict | set | list):
                sizes[f"{mod_name}.{attr}"] = len(value)
    return sizes


@pytest.mark.usefixtures("offline")
def test_deleting_a_thousand_jobs_leaves_nothing_per_job() -> None:
    before = _module_tables()
    for i in range(JOBS):
        _give_state(i)
    assert len(runtime.JOBS) == JOBS
    state = runtime.JOBS.peek("uid-0")
    assert state is not None
    defaults = job_state.JobState()
    unset = [f.name for f in dataclasses.fields(state) if getattr(state, f.name) == getattr(defaults, f.name)]
    assert not unset, f"the test gives a job every part of its state; these stayed empty: {unset}"
    expected = [f.name for f in dataclasses.fields(state.expect) if f.name not in ("grace", "clock")]
    unset = [name for name in expected if getattr(state.expect, name) is None]
    assert not unset, f"the test makes every kind of expectation; these stayed empty: {unset}"
    for i in range(JOBS):
        handlers.on_event(type="DELETED", body=_body(i), patch=kopf.Patch())
    assert len(runtime.JOBS) == 0
    assert _FakeRayJobs.closed == JOBS, "each job's Ray client connection closed, not just dropped"
    assert _FakeScrapeClient.closed == JOBS, "each job's scrape connection closed, not just dropped"
    grew = {k: n for k, n in _module_tables().items() if n >= JOBS and n > before.get(k, 0)}
    assert not grew, f"module tables that kept something per job: {grew}"


@pytest.mark.usefixtures("offline")
def test_the_first_deletion_event_forgets_and_a_later_round_is_forgotten_at_the_last() -> None:
    """kopf delivers a deletion twice (deletionTimestamp set, then DELETED); a round that ran between the
    two made the state again, and the last event drops it."""
    body = _body(1)
    deleting = kopf.Body(
        {**dict(body), "metadata": {**body.metadata, "deletionTimestamp": "2026-11-27T00:00:00Z"}}
    )
    _give_state(1)
    handlers.on_event(type="MODIFIED", body=deleting, patch=kopf.Patch())
    assert len(runtime.JOBS) == 0
    cache.remember_write("uid-1", {"phase": "Running"})
    handlers.on_event(type="DELETED", body=body, patch=kopf.Patch())
    assert len(runtime.JOBS) == 0
