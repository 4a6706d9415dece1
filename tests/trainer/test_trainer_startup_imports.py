"""What a trainer process imports and builds at start-up: the collector paused while it does
(rlhf_trainer.startup_imports), vLLM imported without `scipy.signal` (rollout.engine.import_vllm_llm), and the
probe `rlhf plan` places from a module with no heavy import (rlhf_trainer.plan_probe).

vLLM itself is not imported here (about 10 CPU-seconds): a stand-in `vllm` module records what the engine
does with it. The real engine's start-up is the trainer stage's.
"""

from __future__ import annotations

import gc
import subprocess
import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest
from rlhf_trainer.rollout import engine as engine_mod
from rlhf_trainer.startup_imports import gc_paused

pytestmark = pytest.mark.unit


@pytest.fixture
def collector_on() -> Iterator[None]:
    was = gc.isenabled()
    gc.enable()
    yield
    if not was:
        gc.disable()


def test_the_collector_is_off_inside_and_back_after_even_on_an_error(collector_on: None) -> None:
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():  # nested: the inner block leaves it off for the outer one
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(ValueError), gc_paused():
        raise ValueError("boom")
    assert gc.isenabled()


def test_a_paused_collector_stays_off_after_a_block() -> None:
    was = gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled(), "the block turned on a collector its caller had turned off"
    finally:
        if was:
            gc.enable()


class _StandInVllm(types.ModuleType):
    """A `vllm` module whose `LLM` records the collector's state at the build and what `scipy.signal`
    was in sys.modules while `from vllm import LLM` ran."""

    def __init__(self, seen: dict[str, Any]) -> None:
        super().__init__("vllm")
        self.seen = seen

    def __getattr__(self, name: str) -> Any:
        if name != "LLM":
            raise AttributeError(name)
        seen = self.seen
        seen["scipy.signal at import"] = sys.modules.get("scipy.signal", "absent")

        class LLM:
            def __init__(self, **kwargs: Any) -> None:
                seen["collector on at build"] = gc.isenabled()
                seen["model"] = kwargs["model"]

            def get_tokenizer(self) -> None:
                return None

        return LLM


def test_the_engine_imports_and_builds_vllm_with_the_collector_off_and_scipy_signal_hidden(
    monkeypatch: pytest.MonkeyPatch, collector_on: None
) -> None:
    seen: dict[str, Any] = {}
    monkeypatch.setitem(sys.modules, "vllm", _StandInVllm(seen))
    monkeypatch.delitem(sys.modules, "scipy.signal", raising=False)
    # Where the process runs and its stack-dump registration need Ray and /proc: not what is tested.
    monkeypatch.setattr(engine_mod, "whereabouts", lambda kind, who: {"pod": "here", "gpus": []})
    monkeypatch.setattr(engine_mod.stacks, "arm", lambda *a, **k: None)
    for var in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE"):
        monkeypatch.setenv(var, "set-by-the-test")
    engine_mod.RolloutEngine(0, {"model_path": "/models/m", "device": "cpu", "max_model_len": 64})
    assert seen["model"] == "/models/m"
    assert seen["collector on at build"] is False, "the engine built vLLM with the collector on"
    assert seen["scipy.signal at import"] is None, "scipy.signal was importable while vLLM imported"
    assert gc.isenabled(), "the collector stayed off after the engine's start-up"
    assert "scipy.signal" not in sys.modules, "the hiding entry outlived the import"


def test_a_process_that_imported_scipy_signal_keeps_it(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}
    monkeypatch.setitem(sys.modules, "vllm", _StandInVllm(seen))
    mine = types.ModuleType("scipy.signal")
    monkeypatch.setitem(sys.modules, "scipy.signal", mine)
    engine_mod.import_vllm_llm()
    assert seen["scipy.signal at import"] is mine and sys.modules["scipy.signal"] is mine


def test_the_plan_probe_module_loads_no_torch_and_is_the_one_rlhf_plan_places() -> None:
    """Ray ships the probe by reference: each probe worker imports its module (one worker per pod)."""
    from rlhf_trainer import device_map, plan_probe

    assert device_map.probe is plan_probe.probe
    heavy = ("torch", "rlhf_trainer.config", "pydantic")
    proc = subprocess.run(
        [sys.executable, "-c", f"import sys, rlhf_trainer.plan_probe; print([m for m in {heavy!r} if m in sys.modules])"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", f"the probe's module imports {proc.stdout.strip()}"
