"""Leader election's decisions (election.py): who may take the Lease, and what a take writes."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from rlhf_operator.election import Lease, can_take, from_spec, released, taken, to_spec

pytestmark = pytest.mark.unit
NOW = datetime(2026, 11, 24, 12, 0, 0, tzinfo=UTC)


def held(by: str, renewed_ago: float, duration: int = 15) -> Lease:
    return Lease(by, NOW - timedelta(seconds=renewed_ago), duration, NOW - timedelta(hours=1), 3)


def test_who_may_take_the_lease() -> None:
    assert can_take(None, "b", NOW)  # no Lease yet
    assert can_take(Lease(None, NOW, 15), "b", NOW)  # released
    assert can_take(held("b", 100), "b", NOW)  # mine
    assert not can_take(held("a", 14), "b", NOW)  # another's, renewed within its duration
    assert not can_take(held("a", 15), "b", NOW)  # exactly at the edge: not yet
    assert can_take(held("a", 15.001), "b", NOW)  # expired


def test_a_take_counts_a_transition_only_when_the_holder_changes() -> None:
    renewal = taken(held("a", 5), "a", NOW)
    assert (renewal.holder, renewal.renew_time, renewal.transitions) == ("a", NOW, 3)
    assert renewal.acquire_time == NOW - timedelta(hours=1)  # a renewal keeps the acquire time
    takeover = taken(held("a", 20), "b", NOW)
    assert (takeover.holder, takeover.acquire_time, takeover.transitions) == ("b", NOW, 4)
    assert taken(None, "a", NOW).transitions == 0
    assert taken(released(held("a", 1)), "b", NOW).transitions == 3  # a free Lease: no one lost it


def test_release_frees_it_at_once() -> None:
    free = released(held("a", 1))
    assert free.holder is None and can_take(free, "b", NOW)


def test_spec_round_trip_in_the_api_servers_micro_time() -> None:
    lease = taken(None, "op-0", NOW)
    spec = to_spec(lease)
    assert spec["renewTime"] == "2026-11-24T12:00:00.000000Z"  # six digits, always: MicroTime's form
    assert spec["holderIdentity"] == "op-0" and spec["leaseDurationSeconds"] == 15
    assert from_spec(spec) == lease
    assert from_spec(None) is None
