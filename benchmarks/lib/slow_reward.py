"""A slow reward function for async_reward.py: 50 ms per sample (a remote judge or a sandbox stand-in).

Loaded by the trainer's RewardScorer through its `file.py:function` form, in the scorer's Ray actor.
"""

from __future__ import annotations

import time

SECONDS_PER_SAMPLE = 0.05


def reward(prompts: list[str], responses: list[str]) -> list[float]:
    """Sleeps 50 ms per sample, then scores the share of vowels (the tiny task's reward)."""
    del prompts
    time.sleep(SECONDS_PER_SAMPLE * len(responses))
    out = []
    for r in responses:
        letters = [c for c in r.lower() if c.isalpha()]
        out.append(sum(c in "aeiou" for c in letters) / len(letters) if letters else 0.0)
    return out
