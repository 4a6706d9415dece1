"""ModelsReady and the fetch step's failures: the head pod's fetch-models init container read into a
condition with bytes done and total while it runs, True when it ends, and a permanent failure (a missing
model or revision, refused credentials: exit 2 with its reason) that fails the job at once with that reason,
releasing its cluster; a transient failure (exit 1) leaves the pod to retry."""

from __future__ import annotations

import kopf
import pytest
from rlhf_operator import model_fetch, observe
from rlhf_operator.status import decide
from testkit.status_inputs import SID, fetch_failed, head_pod, job, obs, raycluster_in, remote_job
from testkit.support import condition

pytestmark = pytest.mark.unit

RUNNING = {"state": {"running": {"startedAt": "2026-11-23T11:59:00Z"}}}
PROGRESS = 'Downloading\nRLHF_FETCH {"bytesDone": 1000, "bytesTotal": 0, "model": ""}\nRLHF_FETCH {"bytesDone": 4096, "bytesTotal": 270000000, "model": "model.actor"}\n'


def test_fetching_shows_bytes_done_and_total() -> None:
    d = decide(
        remote_job({"phase": "Provisioning"}),
        obs(raycluster=raycluster_in("unknown"), pods=[head_pod(RUNNING)], fetch_log=PROGRESS),
        SID,
    )
    c = condition(d.status, "ModelsReady")
    assert (c["status"], c["reason"]) == ("False", "Fetching")
    assert c["message"] == "fetching models: 4096 of 270000000 bytes"
    assert d.status["phase"] == "Provisioning" and not d.actions


def test_done_is_true_with_the_bytes_fetched_or_cached() -> None:
    done = {"state": {"terminated": {"exitCode": 0, "message": '{"bytesFetched": 0, "bytesTotal": 0}'}}}
    d = decide(
        remote_job({"phase": "Provisioning"}),
        obs(raycluster=raycluster_in("unknown"), pods=[head_pod(done)]),
        SID,
    )
    c = condition(d.status, "ModelsReady")
    assert (c["status"], c["reason"]) == ("True", "ModelsCached")
    fetched = {"state": {"terminated": {"exitCode": 0, "message": '{"bytesFetched": 9, "bytesTotal": 9}'}}}
    state = model_fetch.fetch_state([head_pod(fetched)], None)
    assert model_fetch.models_condition(state or model_fetch.FetchState("waiting"))[:2] == (
        True,
        "ModelsFetched",
    )


def test_a_ready_cluster_means_the_models_are_ready() -> None:
    d = decide(remote_job({"phase": "Provisioning"}), obs(), SID)
    assert condition(d.status, "ModelsReady")["status"] == "True"


def test_a_fetch_that_ended_between_two_rounds_is_read_from_the_ready_clusters_head() -> None:
    """The tiny model's fetch takes a fraction of a second: the cluster can be ready before a round saw
    the step end, and its bytes still come from the head pod's finished step; a later attempt's head that
    found everything cached says so."""
    fetched = {"state": {"terminated": {"exitCode": 0, "message": '{"bytesFetched": 9, "bytesTotal": 9}'}}}
    d = decide(remote_job({"phase": "Provisioning"}), obs(pods=[head_pod(fetched)]), SID)
    c = condition(d.status, "ModelsReady")
    assert (c["status"], c["reason"], c["message"]) == (
        "True",
        "ModelsFetched",
        "models fetched into the cache (9 bytes)",
    )
    cached = {"state": {"terminated": {"exitCode": 0, "message": '{"bytesFetched": 0, "bytesTotal": 0}'}}}
    again = decide(remote_job(d.status), obs(pods=[head_pod(cached)]), SID)
    assert condition(again.status, "ModelsReady")["reason"] == "ModelsCached"


def test_the_head_pod_is_read_after_ready_only_until_the_models_are_confirmed() -> None:
    unconfirmed = remote_job({"phase": "Running"})
    assert observe._models_unconfirmed(kopf.Body({"status": {"phase": "Running"}}), unconfirmed)
    ready = {"conditions": [{"type": "ModelsReady", "status": "True"}]}
    assert not observe._models_unconfirmed(kopf.Body({"status": ready}), unconfirmed)
    assert not observe._models_unconfirmed(kopf.Body({"status": {}}), job({"phase": "Running"}))


@pytest.mark.parametrize("reason", ["ModelNotFound", "RevisionNotFound", "CredentialsRefused"])
def test_a_permanent_failure_fails_the_job_at_once_with_its_reason(reason: str) -> None:
    for status in (fetch_failed(reason), fetch_failed(reason, restarted=True)):
        d = decide(
            remote_job({"phase": "Provisioning"}),
            obs(raycluster=raycluster_in("unknown"), pods=[head_pod(status)]),
            SID,
        )
        assert d.status["phase"] == "Failed"
        assert condition(d.status, "Failed")["reason"] == reason
        assert condition(d.status, "ModelsReady")["reason"] == reason
        assert f"spec.model.actor: {reason}" in d.status["message"]
        assert d.action_kinds == ["delete_cluster"]  # the cluster stops; no restart
        assert (d.status.get("restarts") or 0) == 0


def test_a_transient_failure_is_left_to_the_pods_retries() -> None:
    status = fetch_failed("FetchFailed", exit_code=1, restarted=True)
    d = decide(
        remote_job({"phase": "Provisioning"}),
        obs(raycluster=raycluster_in("unknown"), pods=[head_pod(status)]),
        SID,
    )
    assert d.status["phase"] == "Provisioning"
    c = condition(d.status, "ModelsReady")
    assert (c["status"], c["reason"]) == ("False", "FetchFailed")


def test_a_job_of_paths_has_no_models_condition() -> None:
    d = decide(
        job({"phase": "Provisioning"}),
        obs(raycluster=raycluster_in("unknown"), pods=[head_pod(fetch_failed("ModelNotFound"))]),
        SID,
    )
    assert d.status["phase"] == "Provisioning"
    assert all(c["type"] != "ModelsReady" for c in d.status.get("conditions", []))


def test_only_a_running_fetch_has_its_log_read() -> None:
    assert model_fetch.fetching_pod([head_pod(RUNNING)]) == "tiny-head-x"
    assert model_fetch.fetching_pod([head_pod(fetch_failed("ModelNotFound"))]) is None
    assert model_fetch.fetching_pod([head_pod(None)]) is None
    assert model_fetch.last_progress("no progress yet\n") is None
