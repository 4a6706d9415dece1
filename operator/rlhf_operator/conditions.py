"""Time stamps and metav1.Condition helpers shared by the operator's pure modules (status, stall, scaling)
and its handlers: RFC 3339 formatting and parsing, and the condition upsert. Pure: standard library only;
must not import any other rlhf_operator module.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any


def iso(ts: datetime) -> str:
    """`ts` as RFC 3339 in UTC to the second, as Kubernetes writes times (`2026-11-23T23:00:00Z`)."""
    return ts.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(value: Any) -> datetime | None:
    """A status time (RFC 3339 text or a datetime) -> datetime; None when absent or unreadable."""
    if not value:
        return None
    if isinstance(value, datetime):
        return value
    try:
        return datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    except ValueError:
        return None


def set_condition(
    conditions: list[dict[str, Any]],
    ctype: str,
    status: bool,
    reason: str,
    message: str,
    now: datetime,
    generation: int | None = None,
) -> list[dict[str, Any]]:
    """Upsert a metav1.Condition; lastTransitionTime changes only when status flips."""
    value = "True" if status else "False"
    out = [dict(c) for c in conditions]
    for c in out:
        if c.get("type") == ctype:
            if c.get("status") != value:
                c["lastTransitionTime"] = iso(now)
            c.update(status=value, reason=reason, message=message)
            if generation is not None:
                c["observedGeneration"] = generation
            return out
    new: dict[str, Any] = {
        "type": ctype,
        "status": value,
        "reason": reason,
        "message": message,
        "lastTransitionTime": iso(now),
    }
    if generation is not None:
        new["observedGeneration"] = generation
    out.append(new)
    return out
