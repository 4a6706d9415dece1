"""Micro-batched vs all-at-once experience: peak memory of the experience phases (docs/benchmarks.md, issue 8).

Both ways run the trainer's real rank code: a `ModelRank` hosting actor + reference (DeepSpeed ZeRO-3,
gloo, one rank, the offline tiny Llama) computes `ref_logprobs` and `old_logprobs` over a packed rollout.
Ours uses `rolloutMicroBatchSize` (32, as in examples/rlhfjob-tiny.yaml); the baseline passes the whole
rollout as one micro-batch, i.e. one padded forward over every sample. Each measurement is a fresh
process, so peaks never leak from one run into the next; peak = VmHWM after resetting it once the models
are loaded, the rollout is built and one identical warm-up micro-batch has run (first-forward allocations
are a one-time cost, not experience memory).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from lib import common

SCALES = (1, 4)


def synthetic_rollout(samples: int, per_prompt: int, prompt_len: int, max_response: int, seed: int) -> Any:
    """A packed rollout with a realistic length spread: responses ~ lognormal, capped at max_response."""
    import torch
    from rlhf_trainer.transfer import PackedRollout

    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(samples):
        resp = int(
            min(
                max_response,
                max(4, torch.empty(1).log_normal_(0, 0.6, generator=g).item() * 0.45 * max_response),
            )
        )
        ids = torch.randint(3, 500, (prompt_len + resp,), generator=g).tolist()
        rows.append((ids[:prompt_len], ids[prompt_len:], [-1.0] * resp))
    return PackedRollout.from_samples(rows, [i // per_prompt for i in range(samples)])


def child(args: argparse.Namespace) -> None:
    """One measurement in this fresh process: setup, reset the peak, run experience, print JSON."""
    import time

    import torch
    from rlhf_trainer.workers.rank import ModelRank, free_port

    torch.manual_seed(0)
    tiny = common.tiny_model()
    base = {
        "zero_stage": 3,
        "bf16": False,
        "offload": False,
        "gradient_checkpointing": False,
        "pad_id": 0,
        "lr_scheduler": "constant",
        "lr_warmup_steps": 0,
        "total_steps": 10,
        "train_micro_batch": args.micro_batch,
        "temperature": 1.0,
        "path": str(tiny / "model"),
        "grad_accum": 1,
    }
    settings = {"actor": {**base, "lr": 1e-5}, "reference": {**base, "lr": 0.0}}
    rank = ModelRank("actor+reference", ["actor", "reference"], 0, 1, "cpu", os.cpu_count() or 1)
    rank.setup("127.0.0.1", free_port(), settings)
    samples = args.prompts * args.scale * args.samples
    rollout = synthetic_rollout(samples, args.samples, args.prompt_len, args.response_len, seed=args.scale)
    micro = args.micro_batch if args.way == "ours" else samples
    # Warm-up, identical for both ways: the first forward allocates for good (thread pools, ZeRO-3 gather
    # buffers, kernel caches; ~150-180 MiB here), which would otherwise be counted as experience memory.
    warm = synthetic_rollout(args.micro_batch, args.samples, args.prompt_len, args.response_len, seed=99)
    rank.shards, rank.local = {0: warm}, {0: {}}
    rank.ref_logprobs({0: []}, args.micro_batch)
    rank.old_logprobs({0: []}, args.micro_batch)
    rank.shards, rank.local = {0: rollout}, {0: {}}
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM: count only what experience adds
    before = common.status_kib("VmRSS")
    t0 = time.perf_counter()
    ref = rank.ref_logprobs({0: []}, micro)  # same shard keys: uses the shards set above
    rank.old_logprobs({0: []}, micro)
    seconds = time.perf_counter() - t0
    peak = common.status_kib("VmHWM")
    assert ref[0].numel() == int(rollout.response_lens.sum())
    common.child_result(
        {
            "before_mib": before / 1024,
            "peak_mib": peak / 1024,
            "added_mib": (peak - before) / 1024,
            "seconds": seconds,
            "samples": samples,
            "tokens": int(rollout.seq_lens.sum()),
            "max_len": int(rollout.seq_lens.max()),
            "micro_batch": micro,
        }
    )


def measure(way: str, scale: int, args: argparse.Namespace) -> dict[str, float]:
    flags = {k: getattr(args, k) for k in ("prompts", "samples", "prompt_len", "response_len", "micro_batch")}
    return common.run_child(
        __file__,
        way,
        scale,
        flags,
        {**os.environ, "DS_ACCELERATOR": "cpu", "RLHF_DEVICE": "cpu"},
        timeout=600,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prompts", type=int, default=16, help="prompts per step at 1x (rolloutBatchSize)")
    p.add_argument("--samples", type=int, default=8, help="samples per prompt")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--response-len", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=32, help="rolloutMicroBatchSize (ours)")
    p.add_argument("--child", choices=["ours", "all_at_once"], help=argparse.SUPPRESS)
    p.add_argument("--scale", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        args.way = args.child
        child(args)
        return

    common.print_machine()
    common.tiny_model()
    runs: dict[tuple[str, int], list[dict[str, float]]] = {}
    ways = ["ours", "all_at_once"]
    for i in range(args.repeats):  # interleaved; order rotated each round
        for way in ways[i % 2 :] + ways[: i % 2]:
            for scale in SCALES:
                runs.setdefault((way, scale), []).append(measure(way, scale, args))

    def med(way: str, scale: int, key: str) -> float:
        return common.median([r[key] for r in runs[(way, scale)]])

    rows = []
    label = {"ours": "ours: micro-batched", "all_at_once": "baseline: all at once"}
    for way in ways:
        for scale in SCALES:
            r = runs[(way, scale)][0]
            rows.append(
                [
                    f"{label[way]} x{scale}",
                    int(r["samples"]),
                    int(r["tokens"]),
                    int(r["micro_batch"]),
                    med(way, scale, "before_mib"),
                    med(way, scale, "peak_mib"),
                    med(way, scale, "added_mib"),
                    med(way, scale, "seconds"),
                ]
            )
    common.table(
        f"Experience (ref_logprobs + old_logprobs) on one ZeRO-3 rank, tiny Llama; {args.samples} samples/prompt, "
        f"<= {args.response_len} response tokens (lognormal spread); medians of {args.repeats} fresh processes each",
        [
            "way, batch",
            "samples",
            "tokens",
            "micro-batch",
            "RSS before MiB",
            "peak RSS MiB",
            "added by experience MiB",
            "seconds",
        ],
        rows,
    )
    growth = {w: med(w, 4, "added_mib") / med(w, 1, "added_mib") for w in ways}
    total = {w: med(w, 4, "peak_mib") / med(w, 1, "peak_mib") for w in ways}
    common.table(
        "Growth from 1x to 4x batch",
        ["way", "whole-process peak growth (RESULT peak_growth)", "added-memory growth"],
        [[label[w], total[w], growth[w]] for w in ways],
    )
    common.result(
        {
            "peak_growth": round(total["ours"], 3),
            "baseline_peak_growth": round(total["all_at_once"], 3),
            "ours_added_mib_1x": round(med("ours", 1, "added_mib"), 1),
            "ours_added_mib_4x": round(med("ours", 4, "added_mib"), 1),
            "baseline_added_mib_1x": round(med("all_at_once", 1, "added_mib"), 1),
            "baseline_added_mib_4x": round(med("all_at_once", 4, "added_mib"), 1),
        }
    )


if __name__ == "__main__":
    main()
