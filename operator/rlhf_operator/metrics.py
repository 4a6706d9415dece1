"""The operator's own Prometheus metrics (names are a contract with the chart's alerts and docs).

Owns metric definitions only; handlers update them. Never labels anything `job` (Prometheus owns it).
"""

from __future__ import annotations

import contextlib
from datetime import datetime
from typing import Any

from prometheus_client import Counter, Gauge, Histogram, make_wsgi_app
from rlhf_api import read_only_http
from rlhf_api.spec import JOB_PHASES

JOBS = Gauge("rlhf_operator_jobs", "RLHFJobs by phase, as last reconciled.", ["namespace", "phase"])
JOB_PHASE = Gauge(
    "rlhf_operator_job_phase",
    "1 for the phase each RLHFJob is in, 0 for the others.",
    ["namespace", "rlhfjob", "phase"],
)
JOB_STALLED = Gauge(
    "rlhf_operator_job_stalled_since_timestamp_seconds",
    "While an RLHFJob has a stall that is not over (status.openStall: from its detection until a later "
    "step completes, through an onStall restart): when it began (the last progress before it).",
    ["namespace", "rlhfjob", "phase"],
)
RECONCILE_SECONDS = Histogram(
    "rlhf_operator_reconcile_duration_seconds",
    "Time of one reconcile of one RLHFJob.",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
RECONCILE_ERRORS = Counter(
    "rlhf_operator_reconcile_errors_total", "Reconciles that raised.", ["namespace", "reason"]
)
SCRAPES = Counter("rlhf_operator_scrapes_total", "Trainer /metrics scrapes by result.", ["result"])
STALLS = Counter("rlhf_operator_stalls_detected_total", "Stalls detected.", ["namespace", "rlhfjob", "phase"])
RESTARTS = Counter(
    "rlhf_operator_restarts_total", "Trainer restarts from checkpoint.", ["namespace", "rlhfjob"]
)
SCALE_DECISIONS = Counter(
    "rlhf_operator_scale_decisions_total", "Engine-count changes.", ["namespace", "rlhfjob", "direction"]
)
CLUSTERS_CREATED = Counter("rlhf_operator_rayclusters_created_total", "RayClusters created.", ["namespace"])

_phase_by_job: dict[tuple[str, str], str] = {}


def record_job_phase(namespace: str, name: str, phase: str | None) -> None:
    """Keep the per-phase job counts and the per-job 0/1 series consistent."""
    key = (namespace, name)
    old = _phase_by_job.get(key)
    if old == phase:
        return
    if phase is None:
        _phase_by_job.pop(key, None)
        for p in JOB_PHASES:
            with contextlib.suppress(KeyError):
                JOB_PHASE.remove(namespace, name, p)
    else:
        _phase_by_job[key] = phase
        for p in JOB_PHASES:
            JOB_PHASE.labels(namespace, name, p).set(1 if p == phase else 0)
    counts: dict[tuple[str, str], int] = {}
    for (ns, _), ph in _phase_by_job.items():
        counts[(ns, ph)] = counts.get((ns, ph), 0) + 1
    namespaces = {ns for ns, _ in _phase_by_job} | {namespace}
    for ns in namespaces:
        for p in JOB_PHASES:
            JOBS.labels(ns, p).set(counts.get((ns, p), 0))


_stall_by_job: dict[tuple[str, str], str] = {}


def record_open_stall(namespace: str, name: str, open_stall: dict[str, Any] | None) -> None:
    """One series per job with an open stall (status.openStall), labelled with its phase; none once over."""
    key = (namespace, name)
    old = _stall_by_job.pop(key, None)
    phase = str(open_stall["phase"]) if open_stall else None
    if old is not None and old != phase:
        with contextlib.suppress(KeyError):
            JOB_STALLED.remove(namespace, name, old)
    if open_stall and phase is not None:
        since = datetime.fromisoformat(str(open_stall["since"]).replace("Z", "+00:00"))
        JOB_STALLED.labels(namespace, name, phase).set(since.timestamp())
        _stall_by_job[key] = phase


def serve(port: int, addr: str) -> None:
    """/metrics only, read-only (docs/security.md), on `addr` (the chart: every address of the pod)."""
    read_only_http.serve(read_only_http.guard(make_wsgi_app(), ["/metrics"]), addr, port)
