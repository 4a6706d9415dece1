"""A chunk's reward built from its requests' scores: sub-batch splits, score checks, assembly in order.

Owns the shapes the reward scorer returns (`RequestScores` per request; `RewardMeta` and `RewardResult`
per chunk) and the rules that join them. Pure (torch only): no Ray, no reward function calls.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

MAX_MESSAGES = 3  # error messages kept per chunk: enough to name the cause, bounded for the driver


@dataclass
class RewardMeta:
    """What the driver learns about a scored chunk (small; the scores themselves stay in the store)."""

    chunk: int
    samples: int
    errors: int
    score_sum: float
    seconds: float  # scoring time summed over the chunk's requests (each request's own wall time)
    messages: list[str] = field(default_factory=list)


@dataclass
class RewardResult:
    scores: torch.Tensor  # float32 [n]; 0 where invalid (never used: valid masks it out)
    valid: torch.Tensor  # bool [n]


@dataclass(frozen=True)
class RequestScores:
    """One request's scores in its samples' order; None marks a reward error (counted, never scored)."""

    chunk: int
    request: int
    scores: list[float | None]
    messages: list[str]
    seconds: float


def sub_batches(n: int, parts: int) -> list[range]:
    """Samples [0, n) cut into min(n, parts) contiguous ranges, sizes differing by at most one: one per
    scorer thread, so an I/O-bound reward waits on all of them at once instead of one after another."""
    if parts < 1:
        raise ValueError(f"need at least one sub-batch, got {parts}")
    k = max(1, min(n, parts))
    bounds = [i * n // k for i in range(k + 1)]
    return [range(bounds[i], bounds[i + 1]) for i in range(k)]


def checked_scores(raw: Sequence[Any], n: int) -> tuple[list[float | None], str]:
    """A reward's raw answer for n samples -> a float or None per sample, and the first error message:
    a wrong count fails every sample (scores cannot be paired), a non-number or non-finite one only itself."""
    if len(raw) != n:
        return [None] * n, f"reward returned {len(raw)} scores for {n} samples"
    out: list[float | None] = []
    msg = ""
    for x in raw:
        try:
            v = float(x)
        except (TypeError, ValueError):
            out.append(None)
            msg = msg or f"reward returned a non-number: {x!r}"
            continue
        if not math.isfinite(v):
            out.append(None)
            msg = msg or f"reward returned a non-finite value: {v}"
            continue
        out.append(v)
    return out, msg


def assemble_chunk(
    chunk: int, requests: Sequence[RequestScores], samples: int
) -> tuple[RewardMeta, RewardResult]:
    """The chunk's reward from its requests' scores, in request order, which is the chunk's sample order
    (the engine packs request i's samples before request i + 1's). Raises when a request is missing,
    repeated or from another chunk, or the count differs from the chunk's samples: a score must never be
    paired with another sample's tokens."""
    order = sorted(requests, key=lambda r: r.request)
    if [r.request for r in order] != list(range(len(order))) or any(r.chunk != chunk for r in order):
        got = [(r.chunk, r.request) for r in requests]
        raise ValueError(
            f"chunk {chunk}: scores of requests {got} are not requests 0..{len(order) - 1} of it"
        )
    scores = [s for r in order for s in r.scores]
    if len(scores) != samples:
        raise ValueError(f"chunk {chunk}: {len(scores)} scores for its {samples} samples")
    valid = torch.tensor([s is not None for s in scores], dtype=torch.bool)
    values = torch.tensor([s if s is not None else 0.0 for s in scores], dtype=torch.float32)
    meta = RewardMeta(
        chunk=chunk,
        samples=samples,
        errors=int((~valid).sum()),
        score_sum=float(values[valid].sum()),
        seconds=sum(r.seconds for r in order),
        messages=[m for r in order for m in r.messages][:MAX_MESSAGES],
    )
    return meta, RewardResult(values, valid)
