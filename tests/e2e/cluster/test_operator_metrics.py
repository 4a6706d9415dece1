"""The operator's own /metrics, served on a real port and scraped live while jobs move through phases.

docs/monitoring.md promises: `rlhf_operator_job_phase{namespace,rlhfjob,phase}` is 1 for the phase a job
is in and 0 for the others; `rlhf_operator_jobs{namespace,phase}` counts the jobs by phase; a deleted
RLHFJob's series are removed. Real control plane, KubeRay, KWOK and the operator process; the jobs'
trainer fails at start-up (a reward module that does not exist), which moves a job to Failed quickly.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from testkit.support import (
    START_FAULT,
    Cluster,
    MetricsWatcher,
    OperatorProcess,
    free_port,
    metric_samples,
    wait_for,
)

pytestmark = pytest.mark.cluster
ROOT = Path(__file__).resolve().parents[3]
PHASES = [
    "Pending",
    "Queued",
    "Provisioning",
    "Running",
    "Stalled",
    "Restarting",
    "Succeeded",
    "Failed",
    "Suspended",
]


def _unretried_failing_job(name: str, suspend: bool) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((ROOT / "examples" / "rlhfjob-tiny.yaml").read_text())
    doc["metadata"] = {"name": name}
    doc["spec"].setdefault("pods", {})["env"] = [START_FAULT]
    doc["spec"]["runPolicy"] = {"backoffLimit": 0, "suspend": suspend}
    return doc


def latest(watcher: MetricsWatcher) -> list[Any]:
    """The operator's job series in the newest scrape."""
    text = watcher.scrapes[-1] if watcher.scrapes else ""
    return [s for s in metric_samples(text) if s.name.startswith("rlhf_operator_job")]


def job_phases(samples: list[Any], ns: str, job: str) -> dict[str, float]:
    """phase -> value of rlhf_operator_job_phase for one job ({} when the job has no series)."""
    return {
        s.labels["phase"]: s.value
        for s in samples
        if s.name == "rlhf_operator_job_phase"
        and s.labels.get("namespace") == ns
        and s.labels["rlhfjob"] == job
    }


def job_counts(samples: list[Any], ns: str) -> dict[str, float]:
    return {
        s.labels["phase"]: s.value
        for s in samples
        if s.name == "rlhf_operator_jobs" and s.labels.get("namespace") == ns
    }


def only(phase: str) -> dict[str, float]:
    return {p: (1.0 if p == phase else 0.0) for p in PHASES}


def counted(**jobs: int) -> dict[str, float]:
    """The expected rlhf_operator_jobs of a namespace: every phase present, 0 unless given."""
    return {p: float(jobs.get(p, 0)) for p in PHASES}


def test_operator_metrics_follow_each_job_phase_count_jobs_and_drop_deleted_jobs(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    port = free_port()
    operator.stop()
    operator.start(RLHF_OPERATOR_METRICS_PORT=str(port))
    scraper = MetricsWatcher(f"http://127.0.0.1:{port}/metrics", interval=0.2)
    try:
        cluster.apply(_unretried_failing_job("watched", suspend=True), namespace)
        cluster.apply(_unretried_failing_job("bystander", suspend=True), namespace)
        wait_for(
            lambda: (
                (
                    job_phases(latest(scraper), namespace, "watched") == only("Suspended")
                    and job_counts(latest(scraper), namespace) == counted(Suspended=2)
                )
                or None
            ),
            60,
            "both jobs Suspended in the operator's metrics",
        )
        mark = len(scraper.scrapes)
        cluster.kubectl(
            "patch", "rlhfjob", "watched", "-n", namespace, "--type=merge",
            "-p", json.dumps({"spec": {"runPolicy": {"suspend": False}}}),
        )  # fmt: skip
        wait_for(
            lambda: (
                (
                    job_phases(latest(scraper), namespace, "watched") == only("Failed")
                    and job_counts(latest(scraper), namespace) == counted(Suspended=1, Failed=1)
                )
                or None
            ),
            240,
            "the resumed job Failed in the operator's metrics (1 Suspended, 1 Failed)",
        )
        # Every scrape on the way: exactly one phase at 1, the seven others at 0, every phase present.
        path: list[str] = []
        for text in scraper.scrapes[mark:]:
            phases = job_phases(metric_samples(text), namespace, "watched")
            assert sorted(phases) == sorted(PHASES), phases
            current = [p for p, v in phases.items() if v == 1.0]
            assert len(current) == 1 and sum(phases.values()) == 1.0, phases
            if not path or path[-1] != current[0]:
                path.append(current[0])
        assert path[0] == "Suspended" and path[-1] == "Failed", path
        assert set(path[1:-1]) & {"Provisioning", "Running"}, f"no active phase seen between: {path}"

        cluster.kubectl("delete", "rlhfjob", "watched", "-n", namespace, "--wait=true", timeout=60)
        wait_for(
            lambda: (
                (
                    not job_phases(latest(scraper), namespace, "watched")
                    and job_counts(latest(scraper), namespace) == counted(Suspended=1)
                )
                or None
            ),
            60,
            "the deleted job's series gone and the counts down to 1 Suspended",
        )
        assert job_phases(latest(scraper), namespace, "bystander") == only("Suspended")
        print(f"\noperator metrics on :{port}: watched went {' -> '.join(path)}; deleted: series removed")
    finally:
        scraper.stop()
