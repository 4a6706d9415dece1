"""What this operator process keeps in memory about each RLHFJob: one `JobState` per job, in one registry
(`JobStates`) keyed by the job's uid, so forgetting a deleted job is one `pop` and nothing per job outlives it.

Owns per-job state only; cluster-wide things (the API client, the watch indexes, Kueue's Workload version,
the configuration) live elsewhere. Must not import kopf or the Kubernetes client.

A registry of our own rather than kopf's per-object `memo`: the deletion path must also close each job's
Jobs API connections (and, in development, stop its Ray job) at a moment we choose, which kopf's own
forgetting of a memo does not do; the RayCluster and pod index handlers get the memo of their own objects,
not the job's; and the helpers and unit tests reach a job's state by uid without a kopf handler call, so a
test can create and delete 1,000 jobs and count what is left.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx
from rlhf_api.spec import TERMINAL_JOB_PHASES, RLHFJob

from rlhf_operator import rayjobs
from rlhf_operator.expectations import DEFAULT_GRACE_SECONDS, Expectations

SecurityObjects = Literal["unmade", "creating", "made"]


@dataclass(slots=True)
class JobState:
    """One job's state in this process; every field is dropped with the job."""

    # The last parse of the job: (resourceVersion, the typed job or the validation error). A round on an
    # unchanged body, the steady state, reuses it instead of validating the whole spec again.
    parsed: tuple[str, RLHFJob | str] | None = None
    # Its writes (status, RayCluster create and patch) that the watch has not shown yet.
    expect: Expectations = field(default_factory=Expectations)
    # Its Secret and NetworkPolicy: not made or found by this process yet, being created in the background
    # after its RayCluster (children.create_cluster), or made or found (once per job and process).
    security: SecurityObjects = "unmade"
    # Whether this process has written its first status (phase Provisioning).
    first_written: bool = False
    # Transient refusals of its RayCluster: (refusals in a row, monotonic time before which not to retry).
    create_backoff: tuple[int, float] | None = None
    # The last scrape of its trainer: (monotonic time, {"metrics": ...} or {"metrics_error": ...}).
    last_scrape: tuple[float, dict[str, Any]] | None = None
    # Its runtime as bound (runtimes.Bound, read once), or the runtimes.RuntimeUnusable that failed it;
    # whether its per-job checkpoint claim has been made or found.
    runtime: Any = None
    claim_ensured: bool = False
    # Its Jobs API clients by head URL and its scrape client, kept between rounds so their connections
    # stay open (config.head_keepalive).
    ray_clients: dict[str, rayjobs.RayJobsClient] = field(default_factory=dict)
    scrape_client: httpx.Client | None = None
    # Its Ray job as last read from the Jobs API while RUNNING (None otherwise): a round whose scrape shows
    # the trainer answering keeps it instead of reading it again (observe.ray_job_and_metrics).
    running_job: rayjobs.RayJobInfo | None = None

    def close(self) -> None:
        """Close the connections it holds open (the job is forgotten: handlers._forget)."""
        for client in self.ray_clients.values():
            client.close()
        self.ray_clients.clear()
        self.close_scrape()

    def close_scrape(self) -> None:
        if self.scrape_client is not None:
            self.scrape_client.close()
            self.scrape_client = None

    def security_due(self, cluster_exists: bool, phase: str | None) -> bool:
        """Whether a reconcile round must create the job's Secret and NetworkPolicy itself: its RayCluster
        exists (whose creation makes them), this process has neither made nor found them and is not making
        them now (a background creation failed; a job from before this operator version, once per process),
        and the job is not over."""
        return cluster_exists and self.security == "unmade" and phase not in TERMINAL_JOB_PHASES


class JobStates:
    """Every job's `JobState`, by uid, its expectations with `grace` seconds to be seen. Handlers run in
    kopf's thread pool, so the table takes a lock."""

    def __init__(self, grace: float = DEFAULT_GRACE_SECONDS) -> None:
        self.grace = grace
        self._states: dict[str, JobState] = {}
        self._lock = threading.Lock()

    def get(self, uid: str) -> JobState:
        """The job's state, made empty on first use."""
        with self._lock:
            state = self._states.get(uid)
            if state is None:
                state = self._states[uid] = JobState(expect=Expectations(self.grace))
            return state

    def peek(self, uid: str) -> JobState | None:
        """The job's state if this process keeps any, without making one."""
        with self._lock:
            return self._states.get(uid)

    def forget(self, uid: str) -> JobState | None:
        """Drop everything kept about the job; the caller closes what the returned state holds open."""
        with self._lock:
            return self._states.pop(uid, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._states)
