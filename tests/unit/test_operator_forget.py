"""Nothing the operator keeps per job outlives the job: after 1,000 jobs are deleted (`handlers._forget`,
what the delete handler runs), every per-job table of the process is empty again (issue 38, item 2)."""

from __future__ import annotations

import time

import kopf
import pytest
from rlhf_operator import handlers

pytestmark = pytest.mark.unit

JOBS = 1000


def _body(i: int) -> kopf.Body:
    return kopf.Body({"metadata": {"namespace": f"ns{i % 7}", "name": f"job-{i}", "uid": f"uid-{i}"},
                      "status": {}})  # fmt: skip


def _tables() -> dict[str, object]:
    """Every per-job table of the handlers module (by uid, or by the RayCluster's (namespace, name))."""
    return {name: getattr(handlers, name) for name in (
        "_unseen_writes", "_parsed", "_created", "_patched_at", "_security_ensured", "_ray_clients",
        "_create_backoff", "_first_written", "_last_scrape",
    )}  # fmt: skip


def test_deleting_a_thousand_jobs_empties_every_per_job_table(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(handlers, "ray_token", lambda body: f"token-{body.metadata.uid}")
    tables = _tables()
    for t in tables.values():
        assert not t, "the tables start empty in a fresh process"  # type: ignore[truthy-bool]
    now = time.monotonic()
    for i in range(JOBS):
        b = _body(i)
        uid, key = f"uid-{i}", (f"ns{i % 7}", f"job-{i}")
        handlers._unseen_writes[uid] = ({"phase": "Running"}, now)
        handlers._parsed[uid] = ("{}", "bad spec")
        handlers._created[key] = ({}, now)
        handlers._patched_at[key] = ("1", now)
        handlers._security_ensured.add(uid)
        handlers._create_backoff[uid] = (1, now)
        handlers._first_written.add(uid)
        handlers._last_scrape[uid] = (now, {})
        handlers._ray_clients[("http://head:8265", handlers.ray_token(b))] = _Closable()  # type: ignore[assignment]
    assert all(len(t) == JOBS for t in tables.values()), {k: len(t) for k, t in tables.items()}  # type: ignore[arg-type]
    for i in range(JOBS):
        handlers._forget(_body(i))
    assert {k: len(t) for k, t in tables.items()} == dict.fromkeys(tables, 0)  # type: ignore[arg-type]
    assert _Closable.closed == JOBS  # each job's Ray client connection closed, not just dropped


class _Closable:
    closed = 0

    def close(self) -> None:
        _Closable.closed += 1
