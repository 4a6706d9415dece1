"""Per-rank packed rollout transfer: the format engines produce and trainer ranks consume.

A `PackedRollout` holds whole prompt groups, concatenated token ids with no padding, plus offsets.
Engines put one per chunk in the object store; the driver moves only refs, `ChunkMeta` and each
request's `FinishedRequest` (texts for the reward, no tokens). Pure torch.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from rlhf_trainer.data import Prompt


@dataclass(frozen=True)
class ChunkMeta:
    """What the driver learns about a chunk without touching its tokens."""

    chunk: int
    rank: int
    engine: int
    samples: int
    prompt_tokens: int
    response_tokens: int
    seconds: float
    digest: str = ""  # of the chunk's token ids (PackedRollout.digest)
    # rollout.agent: the chunk's episode figures (agents.episodes.episode_stats); empty without agents
    agent: dict[str, float] = field(default_factory=dict)

    @property
    def generated_tokens(self) -> int:
        """The response tokens the engines generated: a tool's tokens (rollout.agent) are not."""
        return self.response_tokens - int(self.agent.get("tool_tokens", 0))


@dataclass(frozen=True)
class FinishedRequest:
    """One prompt's samples, streamed the moment its request finishes so its reward starts before the
    rest of the chunk: only what a reward reads (texts and label), never token arrays."""

    chunk: int
    request: int  # the prompt's index within its chunk: its samples' place in the chunk's sample order
    prompt: Prompt
    responses: list[str]
    label: object = None
    # rollout.agent, per sample: the agent's own reward (None: the job's reward scores the response) and
    # why the agent failed ("": it did not; a failed sample is scored as a reward error). Empty: no agent.
    rewards: tuple[float | None, ...] = ()
    failures: tuple[str, ...] = ()


@dataclass(frozen=True)
class ToolActivity:
    """rollout.agent: whether tool calls are running now (`busy`), streamed when that changes so the
    driver marks the `tool` phase in progress while one runs (a hung tool names it in the stall alert)."""

    busy: bool


@dataclass
class PackedRollout:
    """Samples (prompt + response) packed back to back.

    tokens: int64 [sum(seq_lens)]; seq_lens / prompt_lens: int64 [n]; group: int64 [n] (the prompt a
    sample belongs to, global in the step, for group baselines); rollout_logprobs: float32 over response
    tokens only, [sum(seq_lens - prompt_lens)]. loss_mask (rollout.agent), laid out like rollout_logprobs:
    1.0 for a token the model sampled, 0.0 for one a tool or the environment added; None: every response
    token is the model's (`model_mask()` gives it either way).
    """

    tokens: torch.Tensor
    seq_lens: torch.Tensor
    prompt_lens: torch.Tensor
    group: torch.Tensor
    rollout_logprobs: torch.Tensor
    prompts: list[Prompt] = field(default_factory=list)
    responses: list[str] = field(default_factory=list)
    finished: list[bool] = field(default_factory=list)
    labels: list[object] = field(default_factory=list)
    loss_mask: torch.Tensor | None = None

    @property
    def num_samples(self) -> int:
        return int(self.seq_lens.numel())

    @property
    def response_lens(self) -> torch.Tensor:
        return self.seq_lens - self.prompt_lens

    def model_mask(self) -> torch.Tensor:
        """The loss mask over response tokens (float32, packed like rollout_logprobs): ones without one."""
        if self.loss_mask is not None:
            return self.loss_mask
        return torch.ones(int(self.response_lens.sum()), dtype=torch.float32)

    @property
    def model_lens(self) -> torch.Tensor:
        """Each sample's model tokens (int64 [n]): what a loss is taken over; response_lens without a mask."""
        if self.loss_mask is None:
            return self.response_lens
        owner = torch.repeat_interleave(torch.arange(self.num_samples), self.response_lens)
        counts = torch.zeros(self.num_samples, dtype=torch.float64).index_add_(
            0, owner, self.loss_mask.double()
        )
        return counts.round().to(torch.int64)

    def offsets(self) -> torch.Tensor:
        return torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.int64), self.seq_lens]), 0)

    def digest(self) -> str:
        """A short hash of the token ids, prompts and responses together (reproducibility checks)."""
        import hashlib

        parts = [self.seq_lens, self.prompt_lens, self.tokens]
        if self.loss_mask is not None:  # which tokens a tool added is part of what is trained
            parts.append(self.loss_mask)
        data = b"".join(t.to(torch.int64).numpy().tobytes() for t in parts)
        return hashlib.blake2b(data, digest_size=8).hexdigest()

    def nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size() for t in (self.tokens, self.seq_lens, self.prompt_lens, self.group)
        )

    @staticmethod
    def from_samples(
        samples: Sequence[tuple[Sequence[int], Sequence[int], Sequence[float]]],
        groups: Sequence[int],
        prompts: Sequence[Prompt] = (),
        responses: Sequence[str] = (),
        finished: Sequence[bool] = (),
        labels: Sequence[object] = (),
        loss_masks: Sequence[Sequence[int]] | None = None,
    ) -> PackedRollout:
        """samples: (prompt_ids, response_ids, response_logprobs) per sample; loss_masks (rollout.agent):
        per sample, 1 or 0 per response token (None: no loss mask, every response token the model's)."""
        flat: list[int] = []
        lps: list[float] = []
        seq_lens, prompt_lens = [], []
        for prompt_ids, response_ids, logprobs in samples:
            flat.extend(prompt_ids)
            flat.extend(response_ids)
            lps.extend(logprobs)
            seq_lens.append(len(prompt_ids) + len(response_ids))
            prompt_lens.append(len(prompt_ids))
        return PackedRollout(
            tokens=torch.tensor(flat, dtype=torch.int64),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
            prompt_lens=torch.tensor(prompt_lens, dtype=torch.int64),
            group=torch.tensor(list(groups), dtype=torch.int64),
            rollout_logprobs=torch.tensor(lps, dtype=torch.float32),
            prompts=list(prompts),
            responses=list(responses),
            finished=list(finished),
            labels=list(labels),
            loss_mask=None
            if loss_masks is None
            else torch.tensor([float(m) for ms in loss_masks for m in ms], dtype=torch.float32),
        )

    @staticmethod
    def concat(parts: Sequence[PackedRollout]) -> PackedRollout:
        if not parts:
            raise ValueError("no rollout chunks to concatenate")
        return PackedRollout(
            tokens=torch.cat([p.tokens for p in parts]),
            seq_lens=torch.cat([p.seq_lens for p in parts]),
            prompt_lens=torch.cat([p.prompt_lens for p in parts]),
            group=torch.cat([p.group for p in parts]),
            rollout_logprobs=torch.cat([p.rollout_logprobs for p in parts]),
            prompts=[s for p in parts for s in p.prompts],
            responses=[s for p in parts for s in p.responses],
            finished=[f for p in parts for f in p.finished],
            labels=[x for p in parts for x in p.labels],
            loss_mask=torch.cat([p.model_mask() for p in parts])
            if any(p.loss_mask is not None for p in parts)
            else None,
        )

    def select(self, idx: Sequence[int]) -> PackedRollout:
        """A new packed rollout with samples idx (in that order)."""
        off = self.offsets()
        resp_off = torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.int64), self.response_lens]), 0)
        tokens = [self.tokens[int(off[i]) : int(off[i + 1])] for i in idx]
        lps = [self.rollout_logprobs[int(resp_off[i]) : int(resp_off[i + 1])] for i in idx]
        masks = (
            [self.loss_mask[int(resp_off[i]) : int(resp_off[i + 1])] for i in idx]
            if self.loss_mask is not None
            else None
        )
        ix = torch.tensor(list(idx), dtype=torch.int64)
        return PackedRollout(
            tokens=torch.cat(tokens) if tokens else torch.zeros(0, dtype=torch.int64),
            seq_lens=self.seq_lens[ix],
            prompt_lens=self.prompt_lens[ix],
            group=self.group[ix],
            rollout_logprobs=torch.cat(lps) if lps else torch.zeros(0),
            prompts=[self.prompts[i] for i in idx] if self.prompts else [],
            responses=[self.responses[i] for i in idx] if self.responses else [],
            finished=[self.finished[i] for i in idx] if self.finished else [],
            labels=[self.labels[i] for i in idx] if self.labels else [],
            loss_mask=None if masks is None else (torch.cat(masks) if masks else torch.zeros(0)),
        )

    def micro_batches(self, size: int, by_tokens: bool = False) -> Iterator[tuple[int, int]]:
        """[start, end) sample ranges of at most `size` samples; `by_tokens` (packing): as many ranges,
        cut to hold about equal token counts instead (`balance_by_tokens`)."""
        if size <= 0:
            raise ValueError("micro-batch size must be positive")
        if by_tokens:
            yield from balance_by_tokens(self.seq_lens, 0, self.num_samples, -(-self.num_samples // size))
            return
        for start in range(0, self.num_samples, size):
            yield start, min(start + size, self.num_samples)

    def mini_batches(
        self, count: int, micro_batch: int, by_tokens: bool = False
    ) -> list[list[tuple[int, int]]]:
        """`count` contiguous mini-batches of equal size (the last takes any remainder), each as its
        [start, end) micro-batches of at most `micro_batch` samples: one optimizer step per mini-batch.
        `by_tokens` (packing) keeps the mini-batches and their micro-batch counts (DeepSpeed's gradient
        accumulation and ZeRO-3's collectives need the same count on every rank) and cuts each mini-batch
        into micro-batches of about equal token counts instead (`balance_by_tokens`)."""
        if count <= 0 or micro_batch <= 0:
            raise ValueError("mini-batch count and micro-batch size must be positive")
        size = max(1, self.num_samples // count)
        bounds = [min(i * size, self.num_samples) for i in range(count)] + [self.num_samples]
        out = [
            [(s, min(s + micro_batch, end)) for s in range(start, end, micro_batch)]
            for start, end in itertools.pairwise(bounds)
            if end > start
        ]
        if by_tokens:
            out = [balance_by_tokens(self.seq_lens, mb[0][0], mb[-1][1], len(mb)) for mb in out]
        return out


def balance_by_tokens(seq_lens: torch.Tensor, start: int, end: int, parts: int) -> list[tuple[int, int]]:
    """Samples [start, end) cut into `parts` contiguous, non-empty [start, end) ranges of about equal token
    counts: the token budget of a packed micro-batch is the range's tokens / `parts`. A sample goes to the
    part its token midpoint falls in, so no part is more than one sample over the budget."""
    n = end - start
    parts = max(1, min(parts, n))
    if n <= 0:
        return []
    lens = seq_lens[start:end].to(torch.float64)
    mid = torch.cumsum(lens, 0) - lens / 2  # each sample's token midpoint
    total = float(lens.sum())
    cuts = [0]
    for i in range(1, parts):
        c = int(torch.searchsorted(mid, torch.tensor(total * i / parts, dtype=torch.float64)))
        cuts.append(min(max(c, cuts[-1] + 1), n - (parts - i)))  # non-empty, room for the rest
    cuts.append(n)
    return [(start + a, start + b) for a, b in itertools.pairwise(cuts)]


def pad_micro_batch(
    rollout: PackedRollout, start: int, end: int, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-pad samples [start, end) into (input_ids, attention_mask, action_mask) for one forward.

    Padding exists only inside one micro-batch on the rank that computes it, never in transfer.
    action_mask[b, t] is 1 where token t+1 is a response token (the position whose logits predict it).
    """
    off = rollout.offsets()
    lens = rollout.seq_lens[start:end]
    width = int(lens.max()) if lens.numel() else 0
    n = end - start
    ids = torch.full((n, width), pad_id, dtype=torch.int64)
    attn = torch.zeros((n, width), dtype=torch.int64)
    act = torch.zeros((n, max(width - 1, 0)), dtype=torch.float32)
    for row, i in enumerate(range(start, end)):
        L = int(rollout.seq_lens[i])
        P = int(rollout.prompt_lens[i])
        ids[row, :L] = rollout.tokens[int(off[i]) : int(off[i]) + L]
        attn[row, :L] = 1
        act[row, P - 1 : L - 1] = 1.0
    return ids, attn, act


def pack_micro_batch(
    rollout: PackedRollout, start: int, end: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Samples [start, end) back to back in one row, no padding: (input_ids, position_ids, labels,
    action_mask), each [1, N]. Position ids restart at 0 for every sample, which is how transformers
    (5.x, any attention implementation, with no attention mask given) tells packed samples apart: no
    token attends across a sample boundary. labels[t] is token t+1 of the same sample and action_mask[t]
    is 1 where it is a response token (0 on each sample's last position, whose next token is another
    sample's). The response values come out in rollout order, as `unpad_response_values` gives them."""
    off = rollout.offsets()
    first, last = int(off[start]), int(off[end])
    ids = rollout.tokens[first:last].clone()
    n = last - first
    pos = torch.empty(n, dtype=torch.int64)
    labels = torch.zeros(n, dtype=torch.int64)
    act = torch.zeros(n, dtype=torch.float32)
    for i in range(start, end):
        a, L, P = int(off[i]) - first, int(rollout.seq_lens[i]), int(rollout.prompt_lens[i])
        pos[a : a + L] = torch.arange(L)
        labels[a : a + L - 1] = ids[a + 1 : a + L]
        act[a + P - 1 : a + L - 1] = 1.0
    return ids.unsqueeze(0), pos.unsqueeze(0), labels.unsqueeze(0), act.unsqueeze(0)


def packed_rows(rollout: PackedRollout, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the padded layout's positions are in `pack_micro_batch`'s row: (index, inside), each
    [end - start, max seq len - 1]. Position t of row b (the logits that predict token t+1 of sample b) is
    packed position index[b, t]; inside is False past the sample's last prediction. Per-position results
    of the packed forward taken through it line up with `pad_micro_batch`'s action mask, so the loss, its
    aggregation and every statistic run on the same [B, T-1] tensors as the padded path."""
    lens = rollout.seq_lens[start:end]
    width = max(int(lens.max()) - 1, 0) if lens.numel() else 0
    first = torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.int64), lens]), 0)[:-1]
    t = torch.arange(width, dtype=torch.int64).unsqueeze(0)
    inside = t < (lens - 1).unsqueeze(1)
    index = torch.where(inside, first.unsqueeze(1) + t, torch.zeros_like(t))
    return index, inside


ATTENTION_TOKENS_PER_HIDDEN = 10
"""A folded row of width W costs about (1 + W / (10 x hidden size)) per token it holds, padding included:
the linear layers' cost per token grows with hidden^2, attention's with hidden x W. Fitted on this CPU to a
4-layer Llama of hidden 256 (4,096 tokens a forward and backward: rows of 128-512 cost alike, 1,024 +15 %,
2,048 +70 %, one row of 4,096 +90 %) and consistent with the medium (hidden 512) GRPO step that one row per
micro-batch made 33.3 s instead of 19.3 s."""


def attention_tokens(hidden_size: int) -> float:
    """The row width at which attention costs a folded row's tokens as much again (ATTENTION_TOKENS_PER_HIDDEN)."""
    return float(ATTENTION_TOKENS_PER_HIDDEN * max(hidden_size, 1))


def first_fit_decreasing(lens: Sequence[int], width: int) -> list[list[int]]:
    """Sample indexes per row of `width` tokens: longest first, each into the first row with room."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lens)), key=lambda k: -lens[k]):
        for r, free in enumerate(room):
            if lens[i] <= free:
                rows[r].append(i)
                room[r] -= lens[i]
                break
        else:
            rows.append([i])
            room.append(width - lens[i])
    return rows


def fold_layout(lens: Sequence[int], attention_tokens: float) -> tuple[int, list[list[int]]]:
    """The row width and the samples per row (first-fit decreasing) that cost least by
    rows x width x (1 + width / attention_tokens): as narrow as the longest sample when little is padded,
    wider (down to one row) when the padding costs more than the wider attention. The candidates are the
    widths that would hold the tokens in r full rows, r = 1 .. the rows at the longest sample's width."""
    if not lens:
        return 0, []
    longest, total = max(lens), sum(lens)
    narrowest = first_fit_decreasing(lens, longest)
    best = (len(narrowest) * longest * (1 + longest / attention_tokens), longest, narrowest)
    for r in range(len(narrowest) - 1, 0, -1):
        width = max(longest, -(-total // r))
        rows = first_fit_decreasing(lens, width)
        cost = len(rows) * width * (1 + width / attention_tokens)
        if cost < best[0]:
            best = (cost, width, rows)
    return best[1], best[2]


def fold_row(
    ids: torch.Tensor, pos: torch.Tensor, seq_lens: torch.Tensor, attention_tokens: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`pack_micro_batch`'s one row [N] folded into rows (`fold_layout`): (ids [R, W], position ids [R, W],
    flat [N]: where each position of the one row sits in the folded rows, flattened). A sample never
    splits; a row's tail is padding (token 0, position ids restarted, so it is a sample of its own that no
    real token attends to: causal attention looks back only). Attention then costs about N x W, not N x N
    as one long row would (without a varlen kernel the packed row's block-diagonal mask is computed whole).
    `attention_tokens` (`attention_tokens(hidden size)`) prices a wider row."""
    lens = [int(x) for x in seq_lens]
    width, layout = fold_layout(lens, attention_tokens)
    starts = [0, *itertools.accumulate(lens)]
    out_ids = torch.zeros(len(layout), width, dtype=ids.dtype)
    out_pos = torch.zeros(len(layout), width, dtype=pos.dtype)
    flat = torch.empty(ids.numel(), dtype=torch.int64)
    for r, members in enumerate(layout):
        used = 0
        for i in members:
            a, n = starts[i], lens[i]
            out_ids[r, used : used + n] = ids[a : a + n]
            out_pos[r, used : used + n] = pos[a : a + n]
            flat[a : a + n] = r * width + used + torch.arange(n)
            used += n
        out_pos[r, used:] = torch.arange(width - used)
    return out_ids, out_pos, flat


def unpad_response_values(values: torch.Tensor, action_mask: torch.Tensor) -> torch.Tensor:
    """[B, T-1] per-position values -> packed response-token values (concatenated, no padding)."""
    return values[action_mask.bool()]


def split_per_response(packed: torch.Tensor, response_lens: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.split(packed, [int(x) for x in response_lens]))


def pad_response_values(packed: torch.Tensor, action_mask: torch.Tensor) -> torch.Tensor:
    """Inverse of unpad_response_values: scatter packed values into a zero [B, T-1] tensor."""
    out = torch.zeros(action_mask.shape, dtype=packed.dtype)
    out[action_mask.bool()] = packed
    return out


def balance_shards(shards: Sequence[int], sizes: Sequence[int], tokens: Sequence[int]) -> list[int]:
    """A shard (trainer rank) for each generated chunk, so that the ranks' token totals are about even: the
    step waits for the slowest rank in every training phase, and a rank's time follows its tokens, not its
    sample count. Each shard keeps the chunk sizes (prompt counts) it was planned with, so its sample count
    and its micro-batch count stay the same (ZeRO-3's collectives need equal counts) and groups stay whole.
    Greedy: chunks with the most tokens first, each to the shard with the fewest tokens so far that still
    has a slot of its size (ties: the planned shard, then the lowest)."""
    slots: dict[tuple[int, int], int] = {}
    for shard, size in zip(shards, sizes, strict=True):
        slots[(shard, size)] = slots.get((shard, size), 0) + 1
    load = dict.fromkeys(shards, 0)
    out = list(shards)
    for i in sorted(range(len(shards)), key=lambda k: (-tokens[k], k)):
        free = [s for s in sorted(load) if slots.get((s, sizes[i]), 0) > 0]
        best = min(free, key=lambda s: (load[s], s != shards[i], s))
        slots[(best, sizes[i])] -= 1
        load[best] += tokens[i]
        out[i] = best
    return out


def plan_chunks(
    n_prompts: int, shards: int, engines: int, chunks_per_shard: int | None = None
) -> list[tuple[int, int, list[int]]]:
    """Split a step's prompts into chunks of whole prompts: (shard = trainer rank, engine, prompt indices).

    Every shard gets the same number of prompts (so ZeRO-3 ranks run the same number of micro-batches);
    each shard is cut into >= 2 chunks so rewards of early chunks overlap generation of later ones.
    Chunks are ordered round-robin over shards and spread round-robin over engines.
    """
    if shards <= 0 or engines <= 0:
        raise ValueError("need at least one shard and one engine")
    if n_prompts % shards:
        raise ValueError(f"{n_prompts} prompts do not split evenly over {shards} trainer ranks")
    per_shard = n_prompts // shards
    k = chunks_per_shard or max(2, math.ceil(engines / shards))
    k = max(1, min(k, per_shard))
    bounds = [round(i * per_shard / k) for i in range(k + 1)]
    out: list[tuple[int, int, list[int]]] = []
    for c in range(k):
        for shard in range(shards):
            base = shard * per_shard
            idx = list(range(base + bounds[c], base + bounds[c + 1]))
            if idx:
                out.append((shard, len(out) % engines, idx))
    return out
