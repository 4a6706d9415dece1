"""benchmarks/agent_dispatch.py: the skewed workload, today's static chunks as plan_chunks gives them, and
both ways through the trainer's rollout_episodes on the benchmark's STAND-IN timed engines (no Ray, no
model). Speed is the benchmark's to measure; these check what each way ran where."""

from __future__ import annotations

import pytest
from agent_dispatch import measure_standin, skewed_workload, static_assignment

pytestmark = pytest.mark.unit


def test_the_long_episodes_are_a_few_hard_prompts_in_the_first_half() -> None:
    w = skewed_workload()
    assert (w.prompts, w.samples, w.episodes) == (32, 4, 128)
    assert len(w.hard) == 3 and all(p < 16 for p in w.hard)
    assert [t for t in w.turns if t > 1] == [8, 8, 8] and w.turns.count(1) == 29


def test_static_chunks_give_each_engine_half_the_batch_as_plan_chunks_does() -> None:
    w = skewed_workload()
    first, second = static_assignment(w, 2)
    assert first == list(range(64)) and second == list(range(64, 128))
    long_episodes = {p * 4 + s for p in w.hard for s in range(4)}
    assert long_episodes <= set(first)  # every long episode on engine 0, before generation starts


def test_both_ways_run_every_episode_and_dispatch_spreads_the_long_ones() -> None:
    w = skewed_workload()
    m = measure_standin(w, engines=2, per_engine=8, repeats=1, ms_per_token=0.25)
    static, dispatch = m.median("static"), m.median("dispatch")
    # the stand-in generates every turn to its max_tokens: 12 x 8 x 48 long, 116 x 48 short
    assert static.tokens == dispatch.tokens == 12 * 8 * 48 + 116 * 48
    assert static.tool_tokens == dispatch.tool_tokens == 12 * 7 * 8
    assert static.episodes == [64, 64] and static.model_tokens == [12 * 8 * 48 + 52 * 48, 64 * 48]
    assert abs(dispatch.model_tokens[0] - dispatch.model_tokens[1]) <= 8 * 48, dispatch.model_tokens
    assert static.end_reasons == dispatch.end_reasons == {"done": 128}
    keys = m.keys("standin_")
    assert keys["standin_dispatch_speedup"] > 1.0 and keys["standin_static_vs_ideal"] > 1.0, keys
