"""A test reward function the alerting tests steer from outside: it scores the tiny task's vowel share,
raises for some samples, or hangs, as the control file named by RLHF_TEST_REWARD_CONTROL says
(`ok`, `raise` or `hang`). Test-only: loaded by the trainer as `path/to/control_reward.py:reward`.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from rlhf_trainer.tasks.tiny import vowel_share


def _mode() -> str:
    path = os.environ.get("RLHF_TEST_REWARD_CONTROL")
    if not path:
        raise RuntimeError("RLHF_TEST_REWARD_CONTROL is not set: the test names its control file there")
    try:
        return Path(path).read_text().strip() or "ok"
    except FileNotFoundError:
        return "ok"


def reward(prompts: list[str], responses: list[str]) -> list[float]:
    while _mode() == "hang":  # the step cannot complete until the test writes `ok` again
        time.sleep(0.2)
    if _mode() == "raise" and any(len(r) % 2 == 0 for r in responses):
        # The trainer then scores sample by sample: responses of even length are the reward errors.
        raise ValueError("test reward: even-length response")
    return [vowel_share(r) for r in responses]
