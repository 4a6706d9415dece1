"""Leader election's decisions on a `coordination.k8s.io/v1` Lease, as client-go makes them. Pure.

A replica may take the Lease when it is free (no holder), already its own, or expired (not renewed
within `leaseDurationSeconds`). `leader.py` does the reads and writes, with the Lease's resourceVersion,
so that of two replicas racing for it exactly one wins.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

LEASE_DURATION_SECONDS = 15


@dataclass(frozen=True)
class Lease:
    """The fields of a Lease's spec that the election reads (None: unset)."""

    holder: str | None
    renew_time: datetime | None
    duration_seconds: int | None
    acquire_time: datetime | None = None
    transitions: int = 0


def can_take(lease: Lease | None, me: str, now: datetime) -> bool:
    """Whether `me` may write itself as the holder: no Lease, no holder, already mine, or expired."""
    if lease is None or not lease.holder or lease.holder == me:
        return True
    if lease.renew_time is None:
        return True
    return now > lease.renew_time + timedelta(seconds=lease.duration_seconds or LEASE_DURATION_SECONDS)


def taken(lease: Lease | None, me: str, now: datetime, duration: int = LEASE_DURATION_SECONDS) -> Lease:
    """The Lease with `me` holding it as of `now` (a renewal keeps the acquire time and transitions)."""
    mine = lease is not None and lease.holder == me
    return Lease(
        holder=me,
        renew_time=now,
        duration_seconds=duration,
        acquire_time=lease.acquire_time if mine and lease is not None else now,
        transitions=(lease.transitions if lease else 0)
        + (0 if mine or lease is None or not lease.holder else 1),
    )


def released(lease: Lease) -> Lease:
    """Given up on shutdown: no holder, so the next replica need not wait for it to expire."""
    return Lease(None, lease.renew_time, 1, lease.acquire_time, lease.transitions)


def _micro(t: datetime | None) -> str | None:
    return None if t is None else t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _parse(t: Any) -> datetime | None:
    if t is None or isinstance(t, datetime):
        return t
    return datetime.fromisoformat(str(t).replace("Z", "+00:00"))


def to_spec(lease: Lease) -> dict[str, Any]:
    return {
        "holderIdentity": lease.holder,
        "leaseDurationSeconds": lease.duration_seconds,
        "acquireTime": _micro(lease.acquire_time),
        "renewTime": _micro(lease.renew_time),
        "leaseTransitions": lease.transitions,
    }


def from_spec(spec: dict[str, Any] | None) -> Lease | None:
    if spec is None:
        return None
    return Lease(
        holder=spec.get("holderIdentity") or None,
        renew_time=_parse(spec.get("renewTime")),
        duration_seconds=spec.get("leaseDurationSeconds"),
        acquire_time=_parse(spec.get("acquireTime")),
        transitions=int(spec.get("leaseTransitions") or 0),
    )
