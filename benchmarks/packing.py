"""Packed against padded training micro-batches on a skewed length distribution (docs/benchmarks.md, issue 39).

The model: a Llama of 4 layers (hidden 256, 4 heads / 2 KV heads, MLP 768, vocabulary 8,192; random init,
seed 0, fp32), on the CPU. The samples: 64 of them, prompts of 16-48 tokens, responses lognormal (median
48 tokens, sigma 1, capped at 1,024): most are short, a few are long, as RL rollouts are.

Both ways run the trainer's own code over the same samples, in the same run: the micro-batches of
`PackedRollout.micro_batches` (trainMicroBatchSize 8: 8 samples each padded; packed, as many micro-batches
cut to equal token counts) and the forward of `deepspeed_utils.response_logprobs` (padded: right-padded rows
with an attention mask; packed: back to back with position ids restarted, folded into rows first-fit
decreasing at the width that costs least, `transfer.fold_row`), then a token-mean loss and its backward.
Tokens fed are counted as the model received them (a forward pre-hook).
Also, computed (no training): how uneven two trainer ranks' tokens are when the generated chunks go to
the ranks as planned before generation, and by their tokens (`transfer.balance_shards`).
Timed: forward + backward over every micro-batch, the median of 3 repeats after a warm-up. Goals:
padded / packed time >= 1.3, and pad tokens / all tokens in the packed micro-batches <= 0.10.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from lib import common

MODEL: dict[str, Any] = {
    "vocab_size": 8192,
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
}


def samples(n: int, seed: int) -> Any:
    import torch
    from rlhf_trainer.transfer import PackedRollout

    g = torch.Generator().manual_seed(seed)
    out = []
    lens = torch.exp(torch.randn(n, generator=g) + torch.log(torch.tensor(48.0))).clamp(2, 1024).long()
    for r in lens.tolist():
        p = int(torch.randint(16, 49, (1,), generator=g))
        ids = torch.randint(3, MODEL["vocab_size"], (p + r,), generator=g).tolist()
        out.append((ids[:p], ids[p:], [0.0] * r))
    return PackedRollout.from_samples(out, list(range(n)))


def train_pass(model: Any, rollout: Any, micro_batch: int, packed: bool) -> tuple[float, int, int]:
    """Forward + backward over every micro-batch: (seconds, tokens fed to the model, of them padding)."""
    from rlhf_trainer import algorithms
    from rlhf_trainer.workers.deepspeed_utils import response_logprobs

    shapes: list[int] = []  # what the model was fed, as it saw it (padded rows, or packed rows folded)
    hook = model.register_forward_pre_hook(
        lambda _m, _a, kw: shapes.append(int(kw["input_ids"].numel())), with_kwargs=True
    )
    fed = pad = 0
    t0 = time.perf_counter()
    try:
        for s, e in rollout.micro_batches(micro_batch, by_tokens=packed):
            out = response_logprobs(model, rollout, s, e, 0, packed=packed)
            loss = algorithms.aggregate_loss(-out.values, out.mask, "token-mean")
            loss.backward()
            real, width = int(rollout.seq_lens[s:e].sum()), shapes[-1]
            fed, pad = fed + width, pad + width - real
    finally:
        hook.remove()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - t0, fed, pad


def rank_imbalance(steps: int, ranks: int, prompts: int, group: int, seed: int) -> tuple[float, float]:
    """The slowest rank's tokens over the mean rank's, averaged over `steps` GRPO batches (`prompts` x
    `group` samples, the lengths of `samples`): chunks given to ranks as planned (`plan_chunks`, before
    generation) and by their generated tokens (`balance_shards`, what the trainer does)."""
    from rlhf_trainer.transfer import balance_shards, plan_chunks

    chunks = plan_chunks(prompts, shards=ranks, engines=ranks)
    planned, balanced = [], []
    for step in range(steps):
        lens = samples(prompts * group, seed + step).seq_lens.view(prompts, group).sum(1).tolist()
        tokens = [sum(lens[i] for i in idx) for _, _, idx in chunks]
        shards = [s for s, _, _ in chunks]
        for owners, out in (
            (shards, planned),
            (balance_shards(shards, [len(i) for _, _, i in chunks], tokens), balanced),
        ):
            load = [sum(t for o, t in zip(owners, tokens, strict=True) if o == r) for r in range(ranks)]
            out.append(max(load) / (sum(load) / ranks))
    return sum(planned) / steps, sum(balanced) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--balance-steps", type=int, default=200, help="batches for the rank-balance figure")
    args = parser.parse_args()
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    common.print_machine()
    torch.manual_seed(0)
    build: Any = LlamaForCausalLM  # transformers' classes are untyped
    model = build(LlamaConfig(**MODEL)).float().train()
    rollout = samples(args.samples, 1)
    train_pass(model, rollout.select(list(range(8))), 4, True)  # warm-up
    train_pass(model, rollout.select(list(range(8))), 4, False)
    times: dict[bool, list[float]] = {False: [], True: []}
    fed: dict[bool, tuple[int, int]] = {}
    for _ in range(args.repeats):
        for packed in (False, True):  # interleaved: a slow spell of the machine hits both
            seconds, tokens, pad = train_pass(model, rollout, args.micro_batch, packed)
            times[packed].append(seconds)
            fed[packed] = (tokens, pad)
    lens = rollout.response_lens.float()
    rows = []
    for packed in (False, True):
        tokens, pad = fed[packed]
        n = len(list(rollout.micro_batches(args.micro_batch, by_tokens=packed)))
        t = common.median(times[packed])
        rows.append(["packed" if packed else "padded", n, tokens, pad / tokens, t, tokens / t])
    common.table(
        f"{args.samples} samples, responses median {float(lens.median()):.0f} / max {int(lens.max())} tokens, "
        f"{int(rollout.seq_lens.sum())} tokens in all; trainMicroBatchSize {args.micro_batch}; "
        f"forward + backward, median of {args.repeats}",
        ["micro-batches", "count", "tokens fed", "padding fraction", "seconds", "fed tokens/s"],
        rows,
    )
    padded_t, packed_t = common.median(times[False]), common.median(times[True])
    planned, balanced = rank_imbalance(args.balance_steps, 2, 32, 4, 100)
    common.table(
        f"2 trainer ranks, 32 prompts x 4 samples a step (lengths as above), {args.balance_steps} steps: "
        "the slowest rank's tokens / the mean rank's",
        ["chunks to ranks", "imbalance", "training bound by the slowest rank"],
        [
            ["as planned before generation", planned, 1.0],
            ["by generated tokens", balanced, balanced / planned],
        ],
    )
    common.result(
        {
            "train_speedup": round(padded_t / packed_t, 3),
            "padding_fraction": round(fed[True][1] / fed[True][0], 4),
            "padded_padding_fraction": round(fed[False][1] / fed[False][0], 4),
            "padded_seconds": round(padded_t, 3),
            "packed_seconds": round(packed_t, 3),
            "samples": args.samples,
            "tokens": int(rollout.seq_lens.sum()),
            "rank_imbalance_planned": round(planned, 4),
            "rank_imbalance_balanced": round(balanced, 4),
        }
    )


if __name__ == "__main__":
    main()
