"""DAPO's dynamic sampling: a step trains only groups whose rewards differ, refilled from further prompts.

The driver sees each chunk's scores (one float per sample; the tokens stay in the object store), picks
`rolloutBatchSize` informative groups from one or more generation rounds (`pick`, pure), and composes
the step's chunks from them in the layout `plan_chunks` gives a batch of that size (`compose`, a Ray
task per chunk that reads only its own source chunks). The ranks then see an ordinary batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rlhf_trainer.algorithms import informative_groups
from rlhf_trainer.transfer import ChunkMeta, PackedRollout
from rlhf_trainer.workers.reward_results import RewardResult


@dataclass(frozen=True)
class GroupRef:
    """One prompt's group: where its samples are (round, chunk of that round, group within the chunk)."""

    round: int
    chunk: int
    group: int


@dataclass(frozen=True)
class Picked:
    """The groups a step trains, in order, and what was dropped or could not be replaced."""

    groups: list[GroupRef]
    informative: int  # of `groups`, those whose rewards differ
    dropped: int  # equal-reward groups generated and not trained

    @property
    def short(self) -> int:
        """Equal-reward groups trained because the extra rounds ran out."""
        return len(self.groups) - self.informative


def chunk_groups(result: RewardResult, n: int) -> list[bool]:
    """Per group of `n` consecutive samples of a chunk: whether its valid samples' rewards differ (a group
    with fewer than two valid samples has no baseline, so it is not informative)."""
    out = []
    for start in range(0, int(result.scores.numel()), n):
        valid = result.valid[start : start + n]
        scores = [float(x) for x in result.scores[start : start + n][valid]]
        out.append(bool(scores) and informative_groups(scores, len(scores))[0])  # one score: max == min
    return out


def pick(rounds: Sequence[Sequence[list[bool]]], batch: int) -> Picked:
    """`batch` groups from the rounds' per-chunk informative flags: informative ones in generation order,
    then (if the rounds could not supply enough) equal-reward ones from the first round on."""
    good: list[GroupRef] = []
    flat: list[GroupRef] = []
    for r, chunks in enumerate(rounds):
        for c, flags in enumerate(chunks):
            for g, ok in enumerate(flags):
                ref = GroupRef(r, c, g)
                flat.append(ref)
                if ok:
                    good.append(ref)
    chosen = good[:batch]
    n_good = len(chosen)
    if len(chosen) < batch:
        informative = set(good)
        fill = [ref for ref in flat if ref not in informative]
        chosen += fill[: batch - len(chosen)]
    return Picked(chosen, n_good, len(flat) - len(good) - (len(chosen) - n_good))


def informative_count(rounds: Sequence[Sequence[list[bool]]]) -> int:
    return sum(flag for chunks in rounds for flags in chunks for flag in flags)


def compose(
    chunk: int,
    rank: int,
    engine: int,
    first_group: int,
    n: int,
    parts: list[tuple[Any, Any, list[int]]],
    get: Callable[[Any], Any] | None = None,
) -> tuple[PackedRollout, RewardResult, ChunkMeta]:
    """One composed chunk (run as a Ray task): the groups `parts` names ((packed ref, reward result ref,
    group indices) per source chunk), their group ids renumbered from `first_group` in the step. `get`
    reads a ref (ray.get; tests pass the objects themselves)."""
    if get is None:
        import ray

        get = ray.get
    packed, scores, valid = [], [], []
    for packed_ref, result_ref, groups in parts:
        source: PackedRollout = get(packed_ref)
        result: RewardResult = get(result_ref)
        idx = [g * n + i for g in groups for i in range(n)]
        packed.append(source.select(idx))
        ix = torch.tensor(idx, dtype=torch.int64)
        scores.append(result.scores[ix])
        valid.append(result.valid[ix])
    out = PackedRollout.concat(packed)
    out.group = torch.arange(
        first_group, first_group + out.num_samples // n, dtype=torch.int64
    ).repeat_interleave(n)
    meta = ChunkMeta(
        chunk=chunk,
        rank=rank,
        engine=engine,
        samples=out.num_samples,
        prompt_tokens=int(out.prompt_lens.sum()),
        response_tokens=int(out.response_lens.sum()),
        seconds=0.0,
        digest=out.digest(),
    )
    return out, RewardResult(torch.cat(scores), torch.cat(valid)), meta
