"""The tracking sinks' delivery (rlhf_trainer.tracking.dispatch): a bounded queue drained by a thread, each
event retried with capped backoff, every failure and drop counted, and `submit` never blocking the step.

`StubSink` is a stand-in backend (the pure queue logic needs none; the real MLflow, W&B and TensorBoard
sinks are tested in tests/e2e/io/test_tracking_sinks.py). The observer is the real exporter's series.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from rlhf_trainer.metrics import TrainerExporter
from rlhf_trainer.tracking.dispatch import Event, RetryPolicy, SampleRow, SinkDispatcher, short_error

pytestmark = pytest.mark.unit


@dataclass
class StubSink:
    """A stand-in backend: records what it was given; `down` makes every call raise; `gate` holds calls."""

    name: str = "stub"
    down: bool = False
    gate: threading.Event | None = None
    opened: int = 0
    got: list[tuple[str, int, Any]] = field(default_factory=list)
    closed: bool = False

    def _call(self) -> None:
        if self.gate is not None:
            self.gate.wait(10)
        if self.down:
            raise ConnectionError("connection refused")

    def open(self) -> str:
        self._call()
        self.opened += 1
        return "http://stub/run/1"

    def log_params(self, params: dict[str, str]) -> None:
        self._call()
        self.got.append(("params", 0, params))

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self._call()
        self.got.append(("metrics", step, metrics))

    def log_samples(self, step: int, rows: list[SampleRow]) -> None:
        self._call()
        self.got.append(("samples", step, rows))

    def close(self) -> None:
        self.closed = True


def exporter() -> TrainerExporter:
    return TrainerExporter("j", CollectorRegistry())


def series(m: TrainerExporter, name: str) -> float:
    value = m.registry.get_sample_value(name, {"rlhfjob": "j", "sink": "stub"})
    return 0.0 if value is None else value


def wait_until(check: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


FAST = RetryPolicy(attempts=3, base_seconds=0.0, cap_seconds=0.0)


def test_events_are_delivered_in_order_after_the_run_is_opened() -> None:
    sink, m = StubSink(), exporter()
    d = SinkDispatcher(sink, m.tracking, policy=FAST).start()
    d.submit(Event("params", 0, {"a": "1"}))
    d.submit(Event("metrics", 1, {"x": 1.0}))
    d.submit(Event("samples", 1, [SampleRow("p", "c", 0.5)]))
    d.close(5)
    assert sink.opened == 1 and sink.closed
    assert [(k, s) for k, s, _ in sink.got] == [("params", 0), ("metrics", 1), ("samples", 1)]
    assert series(m, "rlhf_tracking_up") == 1.0
    assert m.registry.get_sample_value(
        "rlhf_tracking_run_info", {"rlhfjob": "j", "sink": "stub", "url": "http://stub/run/1"}
    )


def test_submit_never_blocks_on_a_hung_backend_and_counts_what_a_full_queue_drops() -> None:
    gate = threading.Event()  # the backend hangs until released
    sink, m = StubSink(gate=gate), exporter()
    d = SinkDispatcher(sink, m.tracking, capacity=4, policy=FAST).start()
    t0 = time.monotonic()
    accepted = [d.submit(Event("metrics", step, {"x": float(step)})) for step in range(1, 21)]
    assert time.monotonic() - t0 < 0.5, "submit waited for the backend"
    # one event is taken by the (hung) thread, four wait in the queue, the rest are dropped
    assert sum(accepted) in (4, 5) and not all(accepted)
    assert series(m, "rlhf_tracking_dropped_total") == 20 - sum(accepted)
    gate.set()
    d.close(5)
    assert [s for _, s, _ in sink.got] == [s for s, ok in zip(range(1, 21), accepted, strict=True) if ok]


def test_a_failing_call_is_retried_with_backoff_and_each_failure_counted() -> None:
    sink, m = StubSink(down=True), exporter()
    waits: list[float] = []
    policy = RetryPolicy(attempts=4, base_seconds=0.5, cap_seconds=1.5)

    def sleep(seconds: float) -> None:
        waits.append(seconds)
        if len(waits) == 2:
            sink.down = False  # the server is back before the third attempt

    d = SinkDispatcher(sink, m.tracking, policy=policy, sleep=sleep).start()
    d.submit(Event("metrics", 1, {"x": 1.0}))
    d.close(5)
    assert waits == [0.5, 1.0]
    assert sink.got == [("metrics", 1, {"x": 1.0})]
    assert series(m, "rlhf_tracking_errors_total") == 2
    assert series(m, "rlhf_tracking_dropped_total") == 0
    assert series(m, "rlhf_tracking_up") == 1.0


def test_by_default_an_outage_of_any_length_loses_nothing_the_queue_holds() -> None:
    """The default policy never gives an event up while the dispatcher runs: 40 failed calls (minutes of
    capped backoff) and then the server is back, and every queued step arrives, in order."""
    sink, m = StubSink(down=True), exporter()
    waits: list[float] = []

    def sleep(seconds: float) -> None:
        waits.append(seconds)
        if len(waits) == 40:
            sink.down = False

    d = SinkDispatcher(sink, m.tracking, sleep=sleep).start()
    for step in (1, 2, 3):
        d.submit(Event("metrics", step, {"x": float(step)}))
    d.close(5)
    assert [s for _, s, _ in sink.got] == [1, 2, 3]
    assert max(waits) == 15.0 and sum(waits) > 45, sum(waits)  # longer than the old 8 attempts' ~45 s
    assert series(m, "rlhf_tracking_dropped_total") == 0
    assert series(m, "rlhf_tracking_errors_total") == 40


@dataclass
class RefusingSink(StubSink):
    """A backend that refuses one event for good (as MLflow answers 400 to a changed param)."""

    def log_params(self, params: dict[str, str]) -> None:
        raise ValueError("INVALID_PARAMETER_VALUE: changing param values is not allowed")

    def permanent(self, error: BaseException) -> bool:
        return isinstance(error, ValueError)


def test_an_event_the_backend_refuses_is_dropped_at_once_and_the_next_ones_flow() -> None:
    """Retrying until delivered must not hold every later step behind an event the backend refuses."""
    sink, m = RefusingSink(), exporter()
    d = SinkDispatcher(sink, m.tracking, policy=RetryPolicy(base_seconds=0.0, cap_seconds=0.0)).start()
    d.submit(Event("params", 0, {"rollout.engines": "1"}))
    for step in (1, 2):
        d.submit(Event("metrics", step, {"x": 1.0}))
    d.close(5)
    assert [s for kind, s, _ in sink.got if kind == "metrics"] == [1, 2]
    assert series(m, "rlhf_tracking_errors_total") == 1
    assert series(m, "rlhf_tracking_dropped_total") == 1


def test_backoff_doubles_up_to_its_cap() -> None:
    p = RetryPolicy(attempts=8, base_seconds=0.5, cap_seconds=4.0)
    assert [p.delay(k) for k in range(1, 7)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]


def test_a_backend_down_for_good_drops_each_event_after_its_attempts_and_names_the_error() -> None:
    sink, m = StubSink(down=True), exporter()
    d = SinkDispatcher(sink, m.tracking, policy=FAST).start()
    for step in (1, 2):
        d.submit(Event("metrics", step, {"x": 1.0}))
    d.close(5)
    assert sink.got == [] and not sink.closed  # never opened, so nothing to close
    assert series(m, "rlhf_tracking_errors_total") == 6  # 3 attempts x 2 events
    assert series(m, "rlhf_tracking_dropped_total") == 2
    assert series(m, "rlhf_tracking_up") == 0.0
    text = generate_latest(m.registry).decode()
    assert (
        'rlhf_tracking_last_error_info{error="ConnectionError: connection refused",rlhfjob="j",sink="stub"}'
        in text
    )
    assert d.last_error == "ConnectionError: connection refused"


def test_the_last_error_series_is_replaced_not_added() -> None:
    m = exporter()
    m.tracking.tracking_failed("stub", "first")
    m.tracking.tracking_failed("stub", "second")
    text = generate_latest(m.registry).decode()
    assert 'error="second"' in text and 'error="first"' not in text


def test_close_gives_up_at_its_deadline_and_counts_what_was_left() -> None:
    gate = threading.Event()
    sink, m = StubSink(gate=gate), exporter()
    d = SinkDispatcher(sink, m.tracking, policy=FAST).start()
    for step in range(1, 4):
        d.submit(Event("metrics", step, {}))
    t0 = time.monotonic()
    d.close(0.3)
    assert time.monotonic() - t0 < 2.0
    assert series(m, "rlhf_tracking_dropped_total") == 2  # the two queued; the third is in the backend
    gate.set()  # the call in flight still ends (the daemon thread dies with the driver)
    wait_until(lambda: len(sink.got) == 1)


def test_short_error_is_one_bounded_line() -> None:
    e = RuntimeError("a\nb   c" + "x" * 500)
    text = short_error(e)
    assert "\n" not in text and len(text) == 200 and text.startswith("RuntimeError: a b c")
