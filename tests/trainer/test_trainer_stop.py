"""The trainer's stop on SIGTERM (rlhf_trainer.stop): the handler, the budget and the save-or-keep decision.

The decision is pure: these tests give it the times. The real run (tests/e2e/ray/test_trainer_run.py,
the preemption test) proves the driver acts on it.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
from rlhf_api.constants import SHUTDOWN_MARGIN_SECONDS, STOP_BUDGET_ENV
from rlhf_trainer.stop import (
    UNMEASURED_SAVE_SECONDS,
    StopDuringStartUp,
    StopRequest,
    decide_stop,
    estimate_save_seconds,
    kept_line,
    saved_line,
    stop_budget,
)

pytestmark = pytest.mark.unit


def decide(**changes: Any) -> bool:
    """decide_stop on a run that can save (Save, a path, step 7 newer than checkpoint 5, a 2 s save,
    3 s after the signal, a 20 s budget), with `changes` applied; True if it saves."""
    args: dict[str, Any] = dict(
        on_preemption="Save", has_path=True, completed=7, last_checkpoint=5, save_seconds=2.0, elapsed=3.0,
        budget=20.0,
    )  # fmt: skip
    return decide_stop(**{**args, **changes}).save


def test_it_saves_the_step_just_completed_when_the_save_fits_in_what_is_left() -> None:
    assert decide()
    assert decide(save_seconds=17.0)  # 3 s gone, 17 s left: exactly fits
    assert decide(last_checkpoint=0)  # no checkpoint yet: everything since step 0 is worth saving


@pytest.mark.parametrize(
    "changes",
    [
        {"on_preemption": "KeepLast"},
        {"has_path": False},
        {"completed": 5},  # the step's regular checkpoint was just written: nothing newer to save
        {"save_seconds": 17.5},  # 0.5 s more than is left
        {"elapsed": 19.0},  # the step in flight took most of the budget
        {"elapsed": 25.0},  # over the budget already
        {"budget": 0.0},
    ],
)
def test_otherwise_it_keeps_the_last_checkpoint(changes: dict[str, Any]) -> None:
    assert not decide(**changes)


def test_the_reason_says_why() -> None:
    base: dict[str, Any] = dict(has_path=True, completed=7, last_checkpoint=5, elapsed=3.0, budget=20.0)
    assert "KeepLast" in decide_stop(on_preemption="KeepLast", save_seconds=1.0, **base).reason
    late = decide_stop(on_preemption="Save", save_seconds=30.0, **base)
    assert "~30.0 s" in late.reason and "17.0 s of the 20 s budget" in late.reason, late.reason


def test_the_save_estimate_is_this_runs_last_save_else_the_resumed_checkpoints_else_conservative() -> None:
    assert estimate_save_seconds(1.5, 9.0) == 1.5
    assert estimate_save_seconds(None, 9.0) == 9.0
    assert estimate_save_seconds(None, None) == UNMEASURED_SAVE_SECONDS
    # conservative: with the default grace (30 s, less the margin) a run that never saved keeps what it has
    assert UNMEASURED_SAVE_SECONDS > 30 - SHUTDOWN_MARGIN_SECONDS
    assert not decide(save_seconds=estimate_save_seconds(None, None), elapsed=0.0)


def test_the_budget_is_the_operators_env_else_the_spec_grace_less_the_margin() -> None:
    assert stop_budget({STOP_BUDGET_ENV: "45"}, 30) == 45.0
    assert stop_budget({STOP_BUDGET_ENV: " 12.5 "}, 30) == 12.5
    assert stop_budget({}, 30) == 30 - SHUTDOWN_MARGIN_SECONDS
    assert stop_budget({STOP_BUDGET_ENV: ""}, 60) == 60 - SHUTDOWN_MARGIN_SECONDS
    assert stop_budget({STOP_BUDGET_ENV: "soon"}, 60) == 60 - SHUTDOWN_MARGIN_SECONDS  # malformed: the spec's
    assert stop_budget({STOP_BUDGET_ENV: "-3"}, 30) == 0.0


def test_the_lines_the_driver_prints() -> None:
    assert saved_line(12) == "preempted: saved checkpoint at step 12 (lost 0 steps)"
    assert kept_line(10, 12) == "preempted: kept checkpoint at step 10 (2 steps to redo)"
    assert kept_line(12, 12) == "preempted: kept checkpoint at step 12 (0 steps to redo)"
    assert kept_line(0, 3) == "preempted: no checkpoint to keep (3 steps to redo)"


@pytest.fixture
def stop() -> Iterator[StopRequest]:
    before = signal.getsignal(signal.SIGTERM)
    request = StopRequest()
    yield request
    request.restore()
    assert signal.getsignal(signal.SIGTERM) == before


def _deliver() -> None:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.01)  # the handler runs in the main thread at the next bytecode


def test_sigterm_only_records_when_it_came_and_a_second_one_changes_nothing_else(stop: StopRequest) -> None:
    stop.install()
    assert not stop.requested and stop.elapsed() == 0.0
    t0 = time.monotonic()
    _deliver()
    assert stop.requested and stop.signals == 1
    assert stop.at is not None and t0 <= stop.at <= time.monotonic()
    first = stop.at
    # A second SIGTERM (Ray's stop_job, then the preStop hook) raises nothing into the code it interrupts,
    # so it cannot abort a checkpoint save: it is counted, and the budget still counts from the first.
    _deliver()
    assert stop.signals == 2 and stop.at == first
    assert stop.elapsed(first + 4.0) == 4.0


def test_a_sigterm_ends_the_start_up_window_at_once_and_only_that(stop: StopRequest) -> None:
    """Inside `interruptible()` (the driver's start-up, which writes nothing) the SIGTERM raises where the
    main thread is; after the window it is only counted again; a window entered after a stop request
    ends on entry."""
    stop.install()
    went_on = False
    with pytest.raises(StopDuringStartUp), stop.interruptible():
        _deliver()
        went_on = True
    assert not went_on, "the start-up went on after the SIGTERM"
    assert stop.requested and stop.signals == 1
    assert issubclass(StopDuringStartUp, KeyboardInterrupt)  # the one exception Ray's ray.get passes on
    _deliver()  # outside the window: counted, nothing raised
    assert stop.signals == 2
    with pytest.raises(StopDuringStartUp), stop.interruptible():
        went_on = True
    assert not went_on, "a start-up began though a stop was already requested"


def test_install_again_after_ray_init_replaced_it_and_restore_puts_back_the_original(
    stop: StopRequest,
) -> None:
    stop.install()
    signal.signal(signal.SIGTERM, lambda *_: None)  # what ray.init does in a driver
    stop.install()
    _deliver()
    assert stop.signals == 1
    # the fixture checks that restore() put back the handler found before the first install


def test_the_driver_entrypoint_called_in_process_puts_the_sigterm_handler_back() -> None:
    """`python -m rlhf_trainer.driver` keeps its handler to the process's end; a caller in-process (tests)
    gets its own back."""
    from rlhf_trainer import driver

    before = signal.getsignal(signal.SIGTERM)
    assert driver.main(["--spec-json", '{"model": {}}']) == 2
    assert signal.getsignal(signal.SIGTERM) == before
