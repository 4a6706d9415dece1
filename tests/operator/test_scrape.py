"""The operator's reader of the trainer's /metrics (rlhf_operator.scrape), fed by the trainer's own exporter
(rlhf_trainer.metrics): the two sides of the docs/monitoring.md contract are checked against each other."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import kopf
import pytest
from prometheus_client import generate_latest
from rlhf_operator import job_state, observe, runtime
from rlhf_operator.scrape import MalformedMetrics, MetricsUnavailable, fetch_metrics, parse_metrics
from rlhf_operator.scrape import client as scrape_client
from rlhf_trainer.metrics import PhaseTimer, TrainerExporter

pytestmark = pytest.mark.unit


def exported(m: TrainerExporter) -> str:
    return generate_latest(m.registry).decode()


def test_a_fresh_trainer_exposition_parses_with_no_step_and_no_phase() -> None:
    m = TrainerExporter("job-a")
    m.total_steps.labels("job-a").set(20)
    got = parse_metrics(exported(m), "job-a")
    assert got.steps_completed == 0 and got.total_steps == 20
    assert got.in_progress_step_phase is None and got.generation_share is None


def test_a_completed_step_and_a_running_phase_are_read_back() -> None:
    m = TrainerExporter("job-a")
    m.step_done({"generation": 3.0, "reward": 0.5, "actor_train": 1.5}, 5.0)
    m.generated_tokens.labels("job-a").inc(1234)
    m.reward_mean.labels("job-a").set(0.25)
    m.set_engines({"ready": 2, "starting": 1})
    timer = PhaseTimer(m)
    timer.start("generation")
    timer.start(
        "reward"
    )  # rewards start while generation still runs: the later one is what the step waits on
    got = parse_metrics(exported(m), "job-a")
    assert got.steps_completed == 1
    assert got.step_phase_seconds["generation"] == 3.0 and got.generation_share == pytest.approx(3.0 / 5.0)
    assert got.generated_tokens_total == 1234 and got.reward_mean == 0.25
    assert got.engines == {"starting": 1, "ready": 2, "failed": 0, "stopping": 0}
    assert got.in_progress_step_phase == "reward" and got.in_progress_since is not None
    assert got.last_step_completed_ts is not None


def test_the_generation_share_is_of_the_steps_wall_time_when_phases_overlap() -> None:
    """Phases that ran at the same time (reference beside critic, actor beside critic training) each
    report their own seconds, so they sum to more than the step: the autoscaler's share is of the step's
    wall time (rlhf_step_seconds). A trainer image without that gauge falls back to the sum."""
    m = TrainerExporter("job-a")
    m.step_done(
        {"generation": 3.0, "reference": 1.0, "critic_values": 1.0, "actor_train": 2.0, "critic_train": 2.0},
        6.0,
    )
    got = parse_metrics(exported(m), "job-a")
    assert got.step_seconds == 6.0 and got.generation_share == pytest.approx(3.0 / 6.0)  # not 3 / 9
    older = "\n".join(
        line
        for line in exported(m).splitlines()
        if not line.startswith(("rlhf_step_seconds", "# HELP rlhf_step_seconds", "# TYPE rlhf_step_seconds"))
    )
    got = parse_metrics(older + "\n", "job-a")
    assert got.step_seconds == 9.0 and got.generation_share == pytest.approx(3.0 / 9.0)


def test_series_of_another_job_are_ignored() -> None:
    m = TrainerExporter("other")
    m.step_done({"generation": 9.0}, 9.0)
    got = parse_metrics(exported(m), "job-a")
    assert got.steps_completed == 0 and got.step_phase_seconds == {}


@pytest.mark.parametrize(
    "text",
    [
        'rlhf_steps_completed_total{rlhfjob="a"} not-a-number\n',
        'rlhf_step_phase_seconds{rlhfjob="a",phase="generation" 3\n',  # unclosed label set
    ],
)
def test_malformed_text_raises_malformed_metrics(text: str) -> None:
    with pytest.raises(MalformedMetrics):
        parse_metrics(text, "a")


@pytest.fixture
def metrics_endpoint() -> Iterator[dict[str, Any]]:
    state: dict[str, Any] = {"status": 200, "body": b""}

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keeps connections open, as the Ray dashboard and the driver do

        def do_GET(self) -> None:
            state.setdefault("peers", []).append(self.client_address)
            self.send_response(state["status"])
            self.send_header("Content-Length", str(len(state["body"])))
            self.end_headers()
            self.wfile.write(state["body"])

        def log_message(self, *args: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    state["url"] = f"http://127.0.0.1:{httpd.server_address[1]}/metrics"
    yield state
    httpd.shutdown()


def test_fetch_reads_a_live_endpoint(metrics_endpoint: dict[str, Any]) -> None:
    m = TrainerExporter("job-a")
    m.step_done({"generation": 1.0}, 1.0)
    metrics_endpoint["body"] = generate_latest(m.registry)
    assert fetch_metrics(metrics_endpoint["url"], "job-a").steps_completed == 1


def test_a_kept_client_scrapes_over_one_connection_where_each_call_alone_opens_one(
    metrics_endpoint: dict[str, Any],
) -> None:
    """The operator keeps a job's scrape client between rounds (observe.trainer_metrics), so a round reuses
    the connection the round before opened, as long as it stays idle for less than the keep-alive."""
    m = TrainerExporter("job-a")
    metrics_endpoint["body"] = generate_latest(m.registry)
    with scrape_client(30.0) as http:
        for _ in range(3):
            fetch_metrics(metrics_endpoint["url"], "job-a", http)
    assert len(set(metrics_endpoint["peers"])) == 1, metrics_endpoint["peers"]
    for _ in range(2):
        fetch_metrics(
            metrics_endpoint["url"], "job-a"
        )  # the control: a call without a kept client connects anew
    assert len(set(metrics_endpoint["peers"])) == 3, metrics_endpoint["peers"]


def test_a_jobs_rounds_reuse_its_scrape_connection_until_a_scrape_fails(
    metrics_endpoint: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from testkit import status_inputs

    job = status_inputs.job()
    body = kopf.Body({"metadata": {"name": job.name, "namespace": "ns", "uid": "uid-1"}, "status": {}})
    monkeypatch.setattr(runtime, "JOBS", job_state.JobStates())
    monkeypatch.setattr(observe, "metrics_url", lambda cluster, job: metrics_endpoint["url"])
    metrics_endpoint["body"] = generate_latest(TrainerExporter(job.name).registry)

    def round_() -> dict[str, Any]:
        runtime.state_of(body).last_scrape = None  # the scrape interval has passed
        return observe.trainer_metrics(body, job, {})

    for _ in range(3):
        assert "metrics" in round_()
    assert len(set(metrics_endpoint["peers"])) == 1, metrics_endpoint["peers"]
    metrics_endpoint["status"] = 503
    assert "HTTP 503" in round_()["metrics_error"]
    assert runtime.state_of(body).scrape_client is None  # dropped with its connection
    metrics_endpoint["status"] = 200
    assert "metrics" in round_()
    assert len(set(metrics_endpoint["peers"])) == 2, metrics_endpoint["peers"]


def test_fetch_of_an_http_error_is_unavailable(metrics_endpoint: dict[str, Any]) -> None:
    metrics_endpoint["status"] = 503
    with pytest.raises(MetricsUnavailable, match="HTTP 503"):
        fetch_metrics(metrics_endpoint["url"], "job-a")


def test_fetch_of_a_closed_port_is_unavailable() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: connections are refused
        with pytest.raises(MetricsUnavailable, match=str(port)):
            fetch_metrics(f"http://127.0.0.1:{port}/metrics", "job-a", scrape_client(1.0, timeout=2))


LITERAL = """# HELP rlhf_steps_completed_total Steps completed.
# TYPE rlhf_steps_completed_total counter
rlhf_steps_completed_total{rlhfjob="job-a"} 7.0
# HELP rlhf_last_checkpoint_step Step of the last checkpoint written or resumed from.
# TYPE rlhf_last_checkpoint_step gauge
rlhf_last_checkpoint_step{rlhfjob="job-a"} 6.0
rlhf_last_checkpoint_step{rlhfjob="other"} 40.0
"""


def test_the_last_checkpoint_step_is_read_for_this_job_only() -> None:
    assert parse_metrics(LITERAL, "job-a").last_checkpoint_step == 6
    assert parse_metrics(LITERAL, "other").last_checkpoint_step == 40


def test_no_checkpoint_series_means_unknown_not_zero() -> None:
    """An older trainer, or one before its first checkpoint, exports no such series."""
    without = "\n".join(line for line in LITERAL.splitlines() if "checkpoint" not in line) + "\n"
    got = parse_metrics(without, "job-a")
    assert got.steps_completed == 7 and got.last_checkpoint_step is None


def test_async_rl_staleness_idle_ratios_and_stale_samples_are_read_back() -> None:
    m = TrainerExporter("job-a")
    for stale in (0, 1, 1, 1):
        m.sample_staleness.labels("job-a").observe(stale)
    m.trainer_idle_ratio.labels("job-a").set(0.125)
    m.rollout_idle_ratio.labels("job-a").set(0.5)
    m.stale_samples.labels("job-a", "regenerated").inc(128)
    m.stale_samples.labels("job-a", "dropped").inc(64)
    got = parse_metrics(exported(m), "job-a")
    assert got.sample_staleness == pytest.approx(0.75)
    assert (got.trainer_idle_ratio, got.rollout_idle_ratio) == (0.125, 0.5)
    assert got.stale_samples_total == 192  # both actions


def test_no_trained_batch_means_no_staleness_not_zero() -> None:
    got = parse_metrics(exported(TrainerExporter("job-a")), "job-a")
    assert got.sample_staleness is None and got.stale_samples_total == 0


def test_the_evaluation_is_read_back_only_once_it_ran() -> None:
    m = TrainerExporter("job-a")
    before = parse_metrics(exported(m), "job-a")
    assert before.eval_reward_mean is None and before.eval_step is None
    assert before.eval_reward_mean_by_data_source == {}
    m.evaluated(8, 0.625, {"gsm8k": 0.5, "math": 0.75}, errors=2)
    m.step_done({"generation": 3.0, "eval": 1.0}, 5.0)
    got = parse_metrics(exported(m), "job-a")
    assert got.eval_reward_mean == 0.625 and got.eval_step == 8
    assert got.eval_reward_mean_by_data_source == {"gsm8k": 0.5, "math": 0.75}
    assert got.step_phase_seconds["eval"] == 1.0 and got.reward_errors_total == 0.0


def test_agent_episodes_of_the_last_step_are_read_back_and_a_job_without_agents_shows_none() -> None:
    """rollout.agent: the trainer's rlhf_agent_* series (created by `agentic` at the driver's start) into
    the snapshot the operator copies into status.agent; the `tool` phase is a phase like any other."""
    plain = parse_metrics(exported(TrainerExporter("job-a")), "job-a")
    assert plain.agent_tool_calls is None and "rlhf_agent_tool_calls{" not in exported(
        TrainerExporter("job-a")
    )
    m = TrainerExporter("job-a")
    m.agentic()
    m.agent_step({"turns_mean": 1.75, "tool_calls": 12.0, "tool_errors": 2.0, "tool_seconds": 3.5,
                  "end_done": 14.0, "end_tool_timeout": 2.0})  # fmt: skip
    m.phase_in_progress.labels("job-a", "generation").set(1)
    m.phase_started.labels("job-a", "generation").set(100.0)
    m.phase_in_progress.labels("job-a", "tool").set(1)
    m.phase_started.labels("job-a", "tool").set(130.0)
    text = exported(m)
    got = parse_metrics(text, "job-a")
    assert (got.agent_turns_per_episode, got.agent_tool_calls, got.agent_tool_errors, got.agent_tool_seconds) == (
        1.75, 12.0, 2.0, 3.5,
    )  # fmt: skip
    assert 'rlhf_agent_episodes_total{end_reason="tool_timeout",rlhfjob="job-a"} 2.0' in text
    assert got.in_progress_step_phase == "tool"  # a hung tool is what the step waits on
