"""A stall's stack snapshot: when to ask for it, how long to wait, what to keep. Pure: no clock, no I/O.

When the operator declares a step stalled it submits a second Ray job to the job's cluster
(`python -m rlhf_trainer.stacks.snapshot`), which signals every registered process of every node
and prints the verdict and the whole snapshot. The operator waits for it across reconcile rounds,
never longer than `monitoring.stackSnapshotTimeoutSeconds`: then it writes the verdict into the
Stalled condition, an Event and `status.diagnosis`, and the full dump into the ConfigMap
`<job>-stacks` (owned by the job, size-bounded); `onStall: Restart` restarts only after that.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from rlhf_api.constants import STACK_PROCESS_LIMIT_SECONDS, STACKS_LOG_MARKER

from rlhf_operator.conditions import iso, parse_time

MARKER = STACKS_LOG_MARKER
MAX_DUMP_BYTES = 512 * 1024  # a ConfigMap holds 1 MiB; the verdict and the stall's text fit beside it
MAX_SUMMARY_CHARS = 1000
CONFIG_MAP_SUFFIX = "-stacks"


@dataclass(frozen=True)
class SnapshotResult:
    """What the handler saw of the snapshot's Ray job: still running (`done` False), or ended with its
    parsed snapshot, or with `error` (no snapshot line in its log, failed, or gone)."""

    done: bool
    snapshot: dict[str, Any] | None = None
    error: str | None = None


@dataclass
class DiagnosisStep:
    """The next `status.diagnosis` and what to do for it this round."""

    status: dict[str, Any] | None
    submit: str | None = None  # submit the snapshot job with this id
    stop: str | None = None  # stop this snapshot job (past its time limit)
    record: dict[str, Any] | None = None  # write this snapshot into the ConfigMap
    events: list[tuple[str, str]] = field(default_factory=list)  # (reason, message), Warnings
    waiting: bool = False  # the snapshot is being taken: an onStall restart waits for it


def config_map_name(job: str) -> str:
    return f"{job}{CONFIG_MAP_SUFFIX}"


def submission_id(attempt: str, since: datetime, reason: str) -> str:
    """One snapshot per stall and phase: the attempt's id, the stall's start and the stuck phase."""
    phase = reason.rsplit(":", 1)[-1].lower().replace("_", "-") if ":" in reason else "unknown"
    return f"{attempt}-stacks-{int(since.timestamp())}-{phase}"


def entrypoint(timeout_seconds: int) -> str:
    node_timeout = max(10, timeout_seconds - 10)
    args = ["python", "-m", "rlhf_trainer.stacks.snapshot", "--limit", str(STACK_PROCESS_LIMIT_SECONDS)]
    return " ".join(shlex.quote(a) for a in [*args, "--node-timeout", str(node_timeout)])


def parse_log(log: str) -> dict[str, Any] | None:
    """The snapshot from the job's log: its last `RLHF_STACKS {json}` line (None when there is none)."""
    for line in reversed(log.splitlines()):
        if line.startswith(MARKER):
            try:
                value = json.loads(line[len(MARKER) :])
            except ValueError:
                return None
            return value if isinstance(value, dict) else None
    return None


def summary(snapshot: dict[str, Any]) -> str:
    """The verdict in one line (the snapshot job computed it), bounded for a condition's message."""
    lines = [str(x) for x in snapshot.get("verdict") or []]
    text = " | ".join(lines) or "no process of the job answered or was registered"
    return text if len(text) <= MAX_SUMMARY_CHARS else text[: MAX_SUMMARY_CHARS - 1] + "…"


def step(
    current: dict[str, Any] | None,
    stall_since: datetime,
    reason: str,
    attempt: str,
    result: SnapshotResult | None,
    now: datetime,
    timeout_seconds: int,
) -> DiagnosisStep:
    """The diagnosis of the stall that began at `stall_since` in the attempt `attempt`, stuck as `reason`
    says (`PhaseStuck:<phase>`).

    A stall with no diagnosis yet gets one requested, and so does a stall that moved on to another phase
    (a stall declared while the trainer still started up, then stuck in reward: the first snapshot shows
    the start-up). A requested one is taken when its job ended with a snapshot, failed when it ended
    without one, timed out when it runs past `timeout_seconds` (it is stopped then). A diagnosis of this
    stall and phase already taken, failed or timed out stays as it is. With `timeout_seconds` 0 nothing
    is taken."""
    if timeout_seconds <= 0:
        return DiagnosisStep(current)
    if (
        current is None
        or parse_time(current.get("stallSince")) != stall_since
        or current.get("reason") not in (None, reason)
    ):
        return _request(attempt, stall_since, reason, now)
    if current.get("state") != "Taking":
        return DiagnosisStep(current)
    requested = parse_time(current.get("requestedAt")) or now
    seconds = round(max(0.0, (now - requested).total_seconds()), 1)
    out = dict(current)
    if result is not None and result.done:
        out["seconds"] = seconds
        if result.snapshot is not None:
            said = summary(result.snapshot)
            out.update(state="Taken", summary=said)
            n = len(result.snapshot.get("processes") or [])
            return DiagnosisStep(
                out, record=result.snapshot, events=[("StallDiagnosed", f"stacks of {n} processes: {said}")]
            )
        out.update(state="Failed", summary=f"no stack snapshot: {result.error or 'its job printed none'}")
        return DiagnosisStep(out, events=[("StallDiagnosisFailed", out["summary"])])
    if seconds > timeout_seconds:
        why = (
            f"no stack snapshot: the snapshot job {current.get('submissionId')} did not finish within "
            f"monitoring.stackSnapshotTimeoutSeconds={timeout_seconds}"
        )
        out.update(state="TimedOut", seconds=seconds, summary=why)
        return DiagnosisStep(
            out, stop=str(current.get("submissionId")), events=[("StallDiagnosisTimedOut", why)]
        )
    return DiagnosisStep(current, waiting=True)


def _request(attempt: str, stall_since: datetime, reason: str, now: datetime) -> DiagnosisStep:
    """A new snapshot asked for: Taking, its Ray job to submit."""
    sid = submission_id(attempt, stall_since, reason)
    status = {
        "state": "Taking",
        "stallSince": iso(stall_since),
        "reason": reason,
        "submissionId": sid,
        "requestedAt": iso(now),
    }
    return DiagnosisStep(status, submit=sid, waiting=True)


def bounded_dump(snapshot: dict[str, Any], max_bytes: int = MAX_DUMP_BYTES) -> str:
    """The snapshot as JSON within `max_bytes`: when too large, each process keeps only the thread the
    verdict read (`work_thread`), then only its 40 innermost frames, then the text is cut (and says so)."""

    def dumps(value: Any) -> str:
        return json.dumps(value, indent=1)

    text = dumps(snapshot)
    if len(text.encode()) <= max_bytes:
        return text
    slim = json.loads(json.dumps(snapshot))
    for p in slim.get("processes") or []:
        threads = p.get("threads") or []
        p["threads"] = [t for t in threads if t.get("ident") == p.get("work_thread")] or threads[-1:]
    slim["trimmed"] = "other threads than the one the verdict read were left out (size)"
    text = dumps(slim)
    if len(text.encode()) <= max_bytes:
        return text
    for p in slim.get("processes") or []:
        for t in p.get("threads") or []:
            t["frames"] = (t.get("frames") or [])[:40]
    slim["trimmed"] += "; frames beyond the 40 innermost left out"
    text = dumps(slim)
    if len(text.encode()) <= max_bytes:
        return text
    cut = text.encode()[: max_bytes - 100].decode(errors="ignore")
    return cut + f"\n... cut at {max_bytes} bytes (the whole dump was {len(text.encode())})\n"


def config_map(
    job: str,
    namespace: str,
    owner: dict[str, Any],
    stall_message: str,
    diagnosis: dict[str, Any],
    snapshot: dict[str, Any],
) -> dict[str, Any]:
    """The ConfigMap `<job>-stacks` with the verdict (`summary.txt`) and the dump (`stacks.json`),
    owned by the job (garbage-collected with it); `owner` is the job's ownerReference."""
    lines = [
        f"job {namespace}/{job}: stack snapshot taken {snapshot.get('taken_at')} in {snapshot.get('seconds')} s "
        f"({diagnosis.get('seconds')} s after the operator asked; {snapshot.get('limit_seconds')} s per process)",
        f"stall: {stall_message}",
        "",
        *[str(x) for x in snapshot.get("verdict") or []],
    ]
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": config_map_name(job),
            "namespace": namespace,
            "labels": {"rlhf.dev/job": job, "rlhf.dev/content": "stacks"},
            "ownerReferences": [owner],
        },
        "data": {"summary.txt": "\n".join(lines) + "\n", "stacks.json": bounded_dump(snapshot)},
    }
