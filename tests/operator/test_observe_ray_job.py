"""observe.ray_job_and_metrics: a running job's round reads its Ray job from the Jobs API only when its
trainer does not answer a scrape due now with the job's own series; every other round reads it."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import kopf
import pytest
from prometheus_client import generate_latest
from rlhf_operator import job_state, observe, rayjobs, runtime
from rlhf_trainer.metrics import TrainerExporter
from testkit import status_inputs

pytestmark = pytest.mark.unit

JOB = status_inputs.job()
BODY = kopf.Body({"metadata": {"name": JOB.name, "namespace": "ns", "uid": "uid-1"}, "status": {}})


class _Head:
    """The job's Ray head: its Jobs API (counted GETs, a settable status) and its trainer's /metrics."""

    def __init__(self) -> None:
        self.status = rayjobs.RUNNING
        self.gets = 0
        self.metrics_code = 200
        exporter = TrainerExporter(JOB.name)
        exporter.total_steps.labels(JOB.name).set(20)
        self.metrics_body = generate_latest(exporter.registry)


@pytest.fixture
def head(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Head]:
    h = _Head()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            self.send_response(h.metrics_code)
            self.send_header("Content-Length", str(len(h.metrics_body)))
            self.end_headers()
            self.wfile.write(h.metrics_body)

        def log_message(self, *args: Any) -> None:
            pass

    class Jobs:
        def __init__(self, url: str, token: str, keepalive: float) -> None:
            pass

        def get(self, sid: str) -> rayjobs.RayJobInfo:
            h.gets += 1
            return rayjobs.RayJobInfo(sid, h.status, "", None, None)

        def close(self) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    monkeypatch.setattr(runtime, "JOBS", job_state.JobStates())
    monkeypatch.setattr(rayjobs, "RayJobsClient", Jobs)
    monkeypatch.setattr(observe, "ray_token", lambda body: "token")
    monkeypatch.setattr(observe, "dashboard_url", lambda cluster: "http://head:8265")
    monkeypatch.setattr(
        observe, "metrics_url", lambda cluster, job: f"http://127.0.0.1:{httpd.server_address[1]}/m"
    )
    yield h
    httpd.shutdown()


def round_(sid: str = "sid-1", scrape_due: bool = True) -> dict[str, Any]:
    if scrape_due:
        runtime.state_of(BODY).last_scrape = None  # monitoring.scrapeIntervalSeconds has passed
    return observe.ray_job_and_metrics(BODY, JOB, {}, sid)


def test_a_running_trainer_that_answers_its_scrape_spares_the_jobs_api_read(head: _Head) -> None:
    first = round_()
    assert (first["ray_job"].status, head.gets) == (rayjobs.RUNNING, 1) and first["metrics"].total_steps == 20
    for _ in range(3):
        later = round_()
        assert later["ray_job"] is first["ray_job"] and later["metrics"].total_steps == 20
    assert head.gets == 1


def test_a_trainer_that_stops_answering_is_read_from_the_jobs_api_again(head: _Head) -> None:
    round_()
    head.metrics_code, head.status = 503, rayjobs.SUCCEEDED  # the driver exited
    done = round_()
    assert (done["ray_job"].status, head.gets) == (rayjobs.SUCCEEDED, 2), done
    assert runtime.state_of(BODY).running_job is None
    head.metrics_code = 200  # (a trainer answering again changes nothing: the last read was not RUNNING)
    assert round_()["ray_job"].status == rayjobs.SUCCEEDED and head.gets == 3


def test_rounds_without_a_fresh_scrape_of_this_jobs_trainer_read_the_jobs_api(head: _Head) -> None:
    round_()
    round_(scrape_due=False)  # the scrape interval has not passed: nothing new says the driver lives
    assert head.gets == 2
    round_(sid="sid-2")  # a new attempt's submission
    assert head.gets == 3
    other = TrainerExporter("another-job")  # a trainer answering, but not this job's (a shared dev head)
    other.total_steps.labels("another-job").set(20)
    head.metrics_body = generate_latest(other.registry)
    round_(sid="sid-2")
    assert head.gets == 4
