"""The reward of the two agent examples' math jobs (model.reward.function:
examples/agents/math_answer.py:reward): 1.0 when the response's last `Answer: <number>` equals the row's
label (data.labelKey), else 0.0.

Reads the decoded trajectory, tool output included; only the model writes `Answer:` (the calculator's
tool tokens are `<result>...</result>`, the code tool's a ```output block), so a tool cannot answer for it.
"""

from __future__ import annotations

import re

ANSWER = re.compile(r"Answer:\s*(-?\d+(?:\.\d+)?)")


def reward(prompts: list[str], responses: list[str], labels: list[str | None]) -> list[float]:
    """One float per (prompt, response, label); a response with no answer, or a row with no label, gets 0."""
    del prompts
    out = []
    for response, label in zip(responses, labels, strict=True):
        found = ANSWER.findall(response)
        out.append(1.0 if found and label is not None and float(found[-1]) == float(label) else 0.0)
    return out
