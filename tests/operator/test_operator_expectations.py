"""rlhf_operator.expectations: a write is expected until an observation shows it or the grace ends; a job's
expectations go with its state (job_state.JobStates.forget)."""

from __future__ import annotations

import pytest
from rlhf_operator.expectations import Expectations
from rlhf_operator.job_state import JobStates

pytestmark = pytest.mark.unit

GRACE = 15.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def expect(clock: Clock) -> Expectations:
    return Expectations(GRACE, clock)


def test_nothing_is_expected_before_a_write(expect: Expectations) -> None:
    assert not expect.expects_status()
    assert not expect.status_unseen({})
    assert not expect.patch_in_flight("5")
    assert expect.cluster_seen(None) is None


def test_an_empty_status_write_expects_nothing(expect: Expectations) -> None:
    expect.wrote_status({})
    assert not expect.expects_status()


def test_a_status_that_shows_the_write_satisfies_it(expect: Expectations) -> None:
    expect.wrote_status({"phase": "Running", "restarts": 0})
    assert expect.expects_status()
    assert not expect.status_unseen({"phase": "Running", "restarts": 0, "message": "other fields are fine"})
    assert not expect.expects_status(), "satisfied: dropped"


def test_a_status_without_the_write_keeps_it_pending_until_the_grace_ends(
    expect: Expectations, clock: Clock
) -> None:
    expect.wrote_status({"phase": "Running", "restarts": 1})
    assert expect.status_unseen({"phase": "Provisioning"})
    assert expect.status_unseen({"phase": "Running", "restarts": 0}), "every field written must show"
    clock.now += GRACE
    assert expect.status_unseen({"phase": "Provisioning"}), "still pending at exactly the grace"
    clock.now += 0.1
    assert not expect.status_unseen({"phase": "Provisioning"}), (
        "past the grace: the round runs (and redoes it)"
    )
    assert not expect.expects_status()


def test_a_later_write_replaces_the_one_expected(expect: Expectations) -> None:
    expect.wrote_status({"phase": "Running"})
    expect.wrote_status({"phase": "Succeeded"})
    assert expect.status_unseen({"phase": "Running"})
    assert not expect.status_unseen({"phase": "Succeeded"})


def test_a_created_cluster_stands_in_until_the_index_has_it(expect: Expectations, clock: Clock) -> None:
    made, indexed = {"metadata": {"name": "tiny", "resourceVersion": "1"}}, {"metadata": {"name": "tiny"}}
    expect.created_cluster(made)
    assert expect.cluster_seen(None) is made
    clock.now += GRACE - 0.1
    assert expect.cluster_seen(None) is made
    assert expect.cluster_seen(indexed) is indexed, "the index's copy wins and satisfies the creation"
    assert expect.cluster_seen(None) is None, "gone from the index after that: gone"


def test_a_created_cluster_the_index_never_shows_is_dropped_after_the_grace(
    expect: Expectations, clock: Clock
) -> None:
    expect.created_cluster({"metadata": {"name": "tiny"}})
    clock.now += GRACE
    assert expect.cluster_seen(None) is None
    clock.now -= GRACE
    assert expect.cluster_seen(None) is None, "dropped, not hidden"


def test_a_patch_is_in_flight_while_the_version_patched_is_seen(expect: Expectations, clock: Clock) -> None:
    expect.patched_cluster("7")
    assert expect.patch_in_flight("7")
    assert not expect.patch_in_flight("8"), "a newer version: the patch came back"
    assert not expect.patch_in_flight(None)
    clock.now += GRACE
    assert not expect.patch_in_flight("7"), "at the grace: patch again"


def test_deleting_the_cluster_drops_its_patch(expect: Expectations) -> None:
    expect.patched_cluster("7")
    expect.cluster_deleted()
    assert not expect.patch_in_flight("7")


def test_forgetting_the_job_forgets_its_expectations() -> None:
    jobs = JobStates(GRACE)
    expect = jobs.get("uid-1").expect
    expect.wrote_status({"phase": "Running"})
    expect.created_cluster({"metadata": {"name": "tiny"}})
    expect.patched_cluster("7")
    assert jobs.get("uid-1").expect is expect, "one state per job"
    assert jobs.get("uid-2").expect is not expect
    forgotten = jobs.forget("uid-1")
    assert forgotten is not None and forgotten.expect is expect
    fresh = jobs.get("uid-1").expect
    assert fresh.grace == GRACE
    assert not fresh.expects_status() and fresh.cluster_seen(None) is None and not fresh.patch_in_flight("7")
