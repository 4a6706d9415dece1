"""The tiny task's reward: share of vowels among the letters of the response (0 to 1).

Learnable in a few dozen steps by the tiny model (its BPE vocabulary has vowel-only tokens such as
"a", "ou", "ea"); length-normalised so longer responses are not favoured. Pure Python, no imports.
"""

from __future__ import annotations

VOWELS = frozenset("aeiou")


def vowel_share(text: str) -> float:
    letters = [c for c in text.lower() if c.isalpha()]
    if not letters:
        return 0.0
    return sum(c in VOWELS for c in letters) / len(letters)


# vowel_pass: a verifiable (pass/fail) version of the task, as RLVR rewards are
PASS_SHARE = 0.44


def vowel_pass(prompts: list[str], responses: list[str]) -> list[float]:
    """1.0 when at least PASS_SHARE of the response's letters are vowels, else 0.0: a binary reward, so
    many groups score all equal (what dynamic sampling drops)."""
    del prompts
    return [1.0 if vowel_share(r) >= PASS_SHARE else 0.0 for r in responses]


def reward(prompts: list[str], responses: list[str]) -> list[float]:
    """Reward function contract: one float per (prompt, response) pair."""
    del prompts
    return [vowel_share(r) for r in responses]
