"""The operator process's singletons: its configuration (read once, config.py), the limiter of its calls to
Ray heads, and the registry of every job's in-memory state (job_state.py).

Owns nothing else; every adapter module reaches them here, so a test can swap one in one place.
"""

from __future__ import annotations

import kopf

from rlhf_operator import config, throttle
from rlhf_operator.job_state import JobState, JobStates

# The configuration, read once (config.py); the chart sets its environment variables.
CONFIG = config.from_env()
# Calls to Ray heads (Jobs API, trainer /metrics): capped in total and per host (throttle.py).
REMOTE = throttle.RemoteLimiter(CONFIG.remote_concurrency, CONFIG.remote_per_host)
# Everything kept per job (job_state.py), by uid: a deleted job's goes in one pop. A write of
# ours may stay unseen by the watch for CONFIG.unseen_write_grace (expectations.py): a round is skipped
# while the body lacks our last status write, and a new job is left to the create handler until it has
# written the first phase; a RayCluster just created or patched is taken as written.
JOBS = JobStates(CONFIG.unseen_write_grace)


def state_of(body: kopf.Body) -> JobState:
    """The job's state in this process (made empty on first use)."""
    return JOBS.get(body.metadata.uid or "")
