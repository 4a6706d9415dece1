"""Per-rank packed chunks vs one padded batch through the driver (docs/benchmarks.md, issue 8).

Scaled-down batch 256 prompts x 16 samples x up to 8k tokens: 1x = 32 prompts x 16 samples, 4x = 128
prompts x 16, sequences up to 8192 tokens with a long-tailed length spread. Ours is the trainer's real
format and planner (`transfer.plan_chunks`, `PackedRollout`): each engine actor puts one packed chunk
per (rank, chunk) in the object store, the driver sees refs and `ChunkMeta` only, each trainer rank pulls
and concatenates its own chunks (as `ModelRank._load_shards` does). The baseline (OpenRLHF's way before
per-rank refs): engines return their samples to the driver, which pads them into one batch
[samples, max_len] (token ids, attention mask, response log-probs) and puts one slice per rank. The
engines here are stand-ins producing synthetic tokens of the right lengths: 4M+ tokens of vLLM output
cannot be generated on a 2-core CPU; only the data movement is measured. Each run is a fresh process
(own Ray), so the driver's peak RSS (VmHWM) belongs to that run alone.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from lib import common

SCALES = (1, 4)
MAX_TOKENS = 8192


def sample_lengths(n: int, seed: int) -> list[tuple[int, int]]:
    """(prompt, response) lengths: prompts 64-1024, responses lognormal (median 1200), sum <= 8192."""
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p = rng.randint(64, 1024)
        r = int(min(MAX_TOKENS - p, max(8, rng.lognormvariate(7.09, 0.8))))
        out.append((p, r))
    return out


class StandInEngine:
    """Produces chunks of the given lengths (synthetic token ids); packs them like RolloutEngine._pack."""

    def packed_chunk(self, chunk: int, rank: int, groups: list[int], lens: list[tuple[int, int]]) -> Any:
        import torch
        from rlhf_trainer.transfer import ChunkMeta, PackedRollout

        t0 = time.perf_counter()
        total = sum(p + r for p, r in lens)
        resp = sum(r for _, r in lens)
        packed = PackedRollout(
            tokens=torch.randint(3, 32000, (total,), dtype=torch.int64),
            seq_lens=torch.tensor([p + r for p, r in lens], dtype=torch.int64),
            prompt_lens=torch.tensor([p for p, _ in lens], dtype=torch.int64),
            group=torch.tensor(groups, dtype=torch.int64),
            rollout_logprobs=-torch.rand(resp, dtype=torch.float32),
        )
        meta = ChunkMeta(chunk, rank, 0, len(lens), packed.num_samples, resp, time.perf_counter() - t0)
        return meta, packed

    def samples(self, lens: list[tuple[int, int]]) -> list[tuple[Any, Any, int]]:
        """The baseline's engine output: per sample (token ids, response log-probs, prompt length)."""
        import torch

        return [
            (
                torch.randint(3, 32000, (p + r,), dtype=torch.int64),
                -torch.rand(r, dtype=torch.float32),
                p,
            )
            for p, r in lens
        ]


class StandInRank:
    """A trainer rank's receiving end."""

    def load_packed(self, refs: list[Any]) -> dict[str, int]:
        import ray
        from rlhf_trainer.transfer import PackedRollout

        parts = ray.get(refs)
        r = PackedRollout.concat(parts)
        return {
            "samples": r.num_samples,
            "tokens": int(r.seq_lens.sum()),
            "bytes": sum(map(packed_bytes, parts)),
        }

    def load_padded(self, batch: dict[str, Any]) -> dict[str, int]:
        return {"samples": int(batch["input_ids"].shape[0]), "tokens": int(batch["attention_mask"].sum())}


def packed_bytes(p: Any) -> int:
    return int(
        sum(
            t.numel() * t.element_size()
            for t in (p.tokens, p.seq_lens, p.prompt_lens, p.group, p.rollout_logprobs)
        )
    )


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(field)


def child(way: str, scale: int, args: argparse.Namespace) -> None:
    import ray
    import torch
    from rlhf_trainer.transfer import plan_chunks

    common.start_ray(num_cpus=4)
    engines = [ray.remote(StandInEngine).options(num_cpus=0.5).remote() for _ in range(args.engines)]
    ranks = [ray.remote(StandInRank).options(num_cpus=0.5).remote() for _ in range(args.ranks)]
    n_prompts = args.prompts * scale
    lens = sample_lengths(n_prompts * args.samples, seed=scale)
    chunks = plan_chunks(n_prompts, args.ranks, args.engines)
    per_prompt = args.samples

    def lens_of(idx: list[int]) -> list[tuple[int, int]]:
        return [lens[i * per_prompt + j] for i in idx for j in range(per_prompt)]

    ray.get([e.__ray_ready__.remote() for e in engines] + [r.__ray_ready__.remote() for r in ranks])
    import gc

    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    before = _status_kib("VmRSS")
    t0 = time.perf_counter()
    if way == "ours":
        calls = [
            engines[e]
            .packed_chunk.options(num_returns=2)
            .remote(c, s, [i for i in idx for _ in range(per_prompt)], lens_of(idx))
            for c, (s, e, idx) in enumerate(chunks)
        ]
        metas = ray.get([m for m, _ in calls])  # the driver reads metadata only
        shards: dict[int, list[Any]] = {}
        for (s, _, _), (_, ref) in zip(chunks, calls, strict=True):
            shards.setdefault(s, []).append(ref)
        got = ray.get([ranks[s].load_packed.remote(refs) for s, refs in sorted(shards.items())])
        seconds = time.perf_counter() - t0
        moved = sum(g["bytes"] for g in got)  # each packed chunk crosses once: engine -> its rank
        del metas
    else:
        # engines -> driver (compact per-sample tensors), driver pads one batch, one slice per rank
        outs = ray.get([engines[e].samples.remote(lens_of(idx)) for (_, e, idx) in chunks])
        order = [s for (s, _, idx) in chunks for _ in range(len(idx) * per_prompt)]
        samples = [x for out in outs for x in out]
        width = max(int(ids.numel()) for ids, _, _ in samples)
        rwidth = max(int(lp.numel()) for _, lp, _ in samples)
        n = len(samples)
        input_ids = torch.zeros((n, width), dtype=torch.int64)
        attention = torch.zeros((n, width), dtype=torch.bool)
        logprobs = torch.zeros((n, rwidth), dtype=torch.float32)
        for row, (ids, lp, _) in enumerate(samples):
            input_ids[row, : ids.numel()] = ids
            attention[row, : ids.numel()] = True
            logprobs[row, : lp.numel()] = lp
        in_bytes = sum(ids.numel() * 8 + lp.numel() * 4 + 8 for ids, lp, _ in samples)
        out_bytes = 0
        loads = []
        for s in range(args.ranks):
            rows = torch.tensor([i for i, o in enumerate(order) if o == s], dtype=torch.int64)
            part = {
                "input_ids": input_ids[rows],
                "attention_mask": attention[rows],
                "logprobs": logprobs[rows],
            }
            out_bytes += sum(t.numel() * t.element_size() for t in part.values())
            loads.append(ranks[s].load_padded.remote(ray.put(part)))
            del part
        got = ray.get(loads)
        seconds = time.perf_counter() - t0
        moved = in_bytes + out_bytes
        del outs, samples, input_ids, attention, logprobs
    peak = _status_kib("VmHWM")
    assert sum(g["samples"] for g in got) == len(lens)
    print(
        "CHILD "
        + json.dumps(
            {
                "samples": len(lens),
                "tokens": sum(p + r for p, r in lens),
                "bytes": moved,
                "seconds": seconds,
                "driver_before_mib": before / 1024,
                "driver_peak_mib": peak / 1024,
                "driver_added_mib": (peak - before) / 1024,
            }
        ),
        flush=True,
    )
    ray.shutdown()


def measure(way: str, scale: int, args: argparse.Namespace) -> dict[str, float]:
    flags = {k: getattr(args, k) for k in ("prompts", "samples", "engines", "ranks")}
    return common.run_child(__file__, way, scale, flags, dict(os.environ), timeout=900)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prompts", type=int, default=32, help="prompts at 1x (full size: 256)")
    p.add_argument("--samples", type=int, default=16, help="samples per prompt")
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--ranks", type=int, default=2, help="trainer (actor) ranks")
    p.add_argument("--child", choices=["ours", "padded_driver"], help=argparse.SUPPRESS)
    p.add_argument("--scale", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.child, args.scale, args)
        return

    common.print_machine()
    ways = ["ours", "padded_driver"]
    runs: dict[tuple[str, int], list[dict[str, float]]] = {}
    for i in range(args.repeats):
        for way in ways[i % 2 :] + ways[: i % 2]:
            for scale in SCALES:
                runs.setdefault((way, scale), []).append(measure(way, scale, args))

    def med(way: str, scale: int, key: str) -> float:
        return common.median([r[key] for r in runs[(way, scale)]])

    label = {"ours": "ours: per-rank packed chunks", "padded_driver": "baseline: padded batch via driver"}
    rows = []
    for way in ways:
        for scale in SCALES:
            r = runs[(way, scale)][0]
            rows.append(
                [
                    f"{label[way]} x{scale}",
                    int(r["samples"]),
                    int(r["tokens"]),
                    med(way, scale, "bytes") / 2**20,
                    med(way, scale, "seconds"),
                    med(way, scale, "driver_before_mib"),
                    med(way, scale, "driver_peak_mib"),
                    med(way, scale, "driver_added_mib"),
                ]
            )
    common.table(
        f"Rollout transfer, {args.samples} samples/prompt, <= {MAX_TOKENS} tokens, {args.engines} stand-in engines -> "
        f"{args.ranks} ranks; medians of {args.repeats} fresh processes each",
        [
            "way, batch",
            "samples",
            "tokens",
            "MiB moved",
            "seconds",
            "driver RSS before MiB",
            "driver peak MiB",
            "driver added MiB",
        ],
        rows,
    )
    ratio = {s: med("padded_driver", s, "bytes") / med("ours", s, "bytes") for s in SCALES}
    growth = {w: med(w, 4, "driver_peak_mib") / med(w, 1, "driver_peak_mib") for w in ways}
    common.result(
        {
            "bytes_ratio": round(min(ratio.values()), 3),
            "driver_mem_growth": round(growth["ours"], 3),
            "baseline_driver_mem_growth": round(growth["padded_driver"], 3),
            "ours_seconds_4x": round(med("ours", 4, "seconds"), 3),
            "baseline_seconds_4x": round(med("padded_driver", 4, "seconds"), 3),
        }
    )


if __name__ == "__main__":
    main()
