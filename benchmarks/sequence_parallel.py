"""Sequence parallelism: our per-rank distribution vs rank-0-generates-and-broadcasts (issue 10).

One sequence-parallel group of 2 gloo processes (sequenceParallelSize 2 = one data-parallel rank), the
offline tiny Llama with a 4k context, the trainer's real Ulysses forward (`response_logprobs` with
`sequence_parallel`). What differs is how the group's samples reach the ranks and are computed:

- ours: the engines' packed chunks sit in a store (files here, standing in for Ray's object store); each
  rank loads its group's chunks itself and computes experience in `rolloutMicroBatchSize` micro-batches.
- baseline (the pattern issue 10 describes): rank 0 holds every sample of the group, padded as
  generated, broadcasts the full list to the other rank (`broadcast_object_list`), and experience runs
  on the whole list at once.
- baseline + micro-batches (variant, not in RESULT): the same broadcast, then our micro-batched forward.

Rank 0's peak memory is measured as samples per prompt grow 1x -> 8x, each in fresh processes: peak =
VmHWM after resetting it once the model is loaded and one identical warm-up micro-batch has run.
A second table measures, at 4k tokens, the peak per rank of a PPO forward+backward with SP 1 vs SP 2.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from lib import common

SCALES = (1, 8)
WAYS = ("ours", "broadcast", "broadcast_micro")
LABEL = {
    "ours": "ours: per-rank packed chunks, micro-batched",
    "broadcast": "baseline: rank 0 holds + broadcasts all, one forward",
    "broadcast_micro": "variant: rank 0 holds + broadcasts all, micro-batched",
}
LONG_DIR = common.TINY_DIR.parent / (common.TINY_DIR.name + "-4k")


def long_model() -> Path:
    """The tiny Llama with max_position_embeddings 4096 (the default tiny model stays at 512)."""
    if not (LONG_DIR / "model" / "config.json").is_file():
        from rlhf_trainer.tiny_model import TinyModelShape, make_tiny_model

        make_tiny_model(LONG_DIR, shape=TinyModelShape(max_position_embeddings=4096), num_prompts=16)
    return LONG_DIR / "model"


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def synthetic_rollout(samples: int, per_prompt: int, prompt_len: int, max_len: int, seed: int) -> Any:
    """Packed samples with a lognormal response-length spread, the longest capped at max_len tokens."""
    import torch
    from rlhf_trainer.transfer import PackedRollout

    g = torch.Generator().manual_seed(seed)
    rows = []
    max_resp = max_len - prompt_len
    for _ in range(samples):
        resp = int(
            min(max_resp, max(8, torch.empty(1).log_normal_(0, 0.6, generator=g).item() * 0.45 * max_resp))
        )
        ids = torch.randint(3, 500, (prompt_len + resp,), generator=g).tolist()
        rows.append((ids[:prompt_len], ids[prompt_len:], [-1.0] * resp))
    return PackedRollout.from_samples(rows, [i // per_prompt for i in range(samples)])


def _padded_samples(rollout: Any) -> list[dict[str, Any]]:
    """The group's samples as a generator hands them over: padded to the longest, one dict per sample."""
    import torch
    from rlhf_trainer.transfer import pad_micro_batch

    ids, attn, act = pad_micro_batch(rollout, 0, rollout.num_samples, 0)
    lps = torch.zeros_like(act)
    lps[act.bool()] = rollout.rollout_logprobs
    return [
        {"sequences": ids[i].clone(), "attention_mask": attn[i].clone(), "action_mask": act[i].bool().clone(),
         "rollout_logprobs": lps[i].clone(), "prompt_len": int(rollout.prompt_lens[i]), "group": int(rollout.group[i])}
        for i in range(rollout.num_samples)
    ]  # fmt: skip


def _packed_from_padded(samples: list[dict[str, Any]]) -> Any:
    from rlhf_trainer.transfer import PackedRollout

    rows = []
    for s in samples:
        n = int(s["attention_mask"].sum())
        ids = s["sequences"][:n].tolist()
        p = s["prompt_len"]
        rows.append((ids[:p], ids[p:], s["rollout_logprobs"][s["action_mask"]].tolist()))
    return PackedRollout.from_samples(rows, [s["group"] for s in samples])


def _rank(rank: int, port: int, args: dict[str, Any], store: str, results: Any) -> None:
    """One rank of the SP group: load the model, warm up, reset the peak, run experience, report."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    from rlhf_trainer import sequence_parallel
    from rlhf_trainer.transfer import PackedRollout
    from rlhf_trainer.workers.deepspeed_utils import response_logprobs
    from transformers import AutoModelForCausalLM

    sp = sequence_parallel.init_groups(2)
    model: Any = AutoModelForCausalLM.from_pretrained(args["model"], dtype=torch.float32)
    model.eval()
    sequence_parallel.enable(model, sp)
    micro = int(args["micro_batch"])
    warm = synthetic_rollout(micro, 1, args["prompt_len"], args["max_len"], seed=99)
    with torch.no_grad():
        response_logprobs(model, warm, 0, warm.num_samples, 0, 1.0, sp).packed()
    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM: count what experience adds
    before = _status_kib("VmRSS")
    t0 = time.perf_counter()
    way = args["way"]
    if way == "ours":  # each rank pulls its group's chunks itself; nothing crosses between ranks
        rollout = PackedRollout.concat(
            [torch.load(p, weights_only=False) for p in sorted(Path(store).glob("chunk-*.pt"))]
        )
        sizes = list(range(0, rollout.num_samples, micro))
    else:  # rank 0 generated (holds) the whole group's samples and broadcasts the full list
        box: list[Any] = [None]
        if rank == 0:
            full = torch.load(Path(store) / "all.pt", weights_only=False)
            box = [_padded_samples(full)]
            del full
        dist.broadcast_object_list(box, src=0)
        rollout = _packed_from_padded(box[0])
        step = micro if way == "broadcast_micro" else rollout.num_samples
        sizes = list(range(0, rollout.num_samples, step))
    width = sizes[1] - sizes[0] if len(sizes) > 1 else rollout.num_samples
    out = []
    with torch.no_grad():
        for s in sizes:
            out.append(
                response_logprobs(model, rollout, s, min(s + width, rollout.num_samples), 0, 1.0, sp).packed()
            )
    seconds = time.perf_counter() - t0
    peak = _status_kib("VmHWM")
    assert int(torch.cat(out).numel()) == int(rollout.response_lens.sum())
    results.put({"rank": rank, "before_mib": before / 1024, "peak_mib": peak / 1024,
                 "added_mib": (peak - before) / 1024, "seconds": seconds, "samples": rollout.num_samples,
                 "tokens": int(rollout.seq_lens.sum()), "max_len": int(rollout.seq_lens.max())})  # fmt: skip
    dist.destroy_process_group()


def child(args: argparse.Namespace) -> None:
    """One measurement: the 'engines' write the group's samples, then 2 fresh ranks run experience."""
    import multiprocessing as mp
    import tempfile

    import torch

    samples = args.prompts * args.samples * args.scale
    per_prompt = args.samples * args.scale
    rollout = synthetic_rollout(samples, per_prompt, args.prompt_len, args.max_len, seed=args.scale)
    with tempfile.TemporaryDirectory() as store:
        if args.way == "ours":  # chunks of whole prompt groups, as transfer.plan_chunks cuts a shard
            for c in range(args.chunks):
                idx = [i for i in range(samples) if (i // per_prompt) % args.chunks == c]
                torch.save(rollout.select(idx), Path(store) / f"chunk-{c:03d}.pt")
        else:
            torch.save(rollout, Path(store) / "all.pt")
        del rollout
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        wire = {"model": str(long_model()), "micro_batch": args.micro_batch, "prompt_len": args.prompt_len,
                "max_len": args.max_len, "way": args.way}  # fmt: skip
        port = _free_port()
        procs = [ctx.Process(target=_rank, args=(r, port, wire, store, results)) for r in range(2)]
        for p in procs:
            p.start()
        got = {}
        for _ in procs:
            r = results.get(timeout=900)
            got[r["rank"]] = r
        for p in procs:
            p.join(60)
    if [p.exitcode for p in procs] != [0, 0]:
        sys.exit(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
    print("CHILD " + json.dumps({**got[0], "rank1_added_mib": got[1]["added_mib"]}), flush=True)


# ---- SP 1 vs SP 2 at long sequences: peak per rank of a PPO forward + backward ------------------------


def _long_rank(rank: int, world: int, port: int, model_path: str, seq: int, batch: int, results: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from rlhf_trainer import algorithms, sequence_parallel
    from rlhf_trainer.workers.deepspeed_utils import response_logprobs
    from transformers import AutoModelForCausalLM

    sp = sequence_parallel.init_groups(world) if world > 1 else None
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    sequence_parallel.enable(model, sp)

    def train_micro_batch(rollout: Any) -> None:
        model.zero_grad(set_to_none=False)
        out = response_logprobs(model, rollout, 0, rollout.num_samples, 0, 1.0, sp)
        old = out.values.detach() + 0.01
        loss, _ = algorithms.policy_loss(out.values, old, torch.ones_like(old), out.mask, 0.2)
        torch.autograd.backward(loss * world / max(float(out.mask.sum()), 1.0))

    train_micro_batch(synthetic_rollout(batch, 1, 32, 256, seed=98))  # warm-up: grads, thread pools
    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")
    before = _status_kib("VmRSS")
    # every sample at full length: the worst case the memory has to fit
    from rlhf_trainer.transfer import PackedRollout

    g = torch.Generator().manual_seed(1)
    rows = [(torch.randint(3, 500, (64,), generator=g).tolist(), torch.randint(3, 500, (seq - 64,), generator=g).tolist(),
             [-1.0] * (seq - 64)) for _ in range(batch)]  # fmt: skip
    rollout = PackedRollout.from_samples(rows, list(range(batch)))
    t0 = time.perf_counter()
    train_micro_batch(rollout)
    seconds = time.perf_counter() - t0
    peak = _status_kib("VmHWM")
    results.put(
        {"rank": rank, "added_mib": (peak - before) / 1024, "peak_mib": peak / 1024, "seconds": seconds}
    )
    dist.destroy_process_group()


def long_child(args: argparse.Namespace) -> None:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    world = args.scale  # the SP size
    port = _free_port()
    procs = [
        ctx.Process(
            target=_long_rank,
            args=(r, world, port, str(long_model()), args.long_seq, args.long_batch, results),
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    got = [results.get(timeout=900) for _ in procs]
    for p in procs:
        p.join(60)
    if any(p.exitcode for p in procs):
        sys.exit(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
    worst = max(got, key=lambda r: r["added_mib"])
    print("CHILD " + json.dumps({"added_mib": worst["added_mib"], "peak_mib": worst["peak_mib"],
                                 "seconds": max(r["seconds"] for r in got)}), flush=True)  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--prompts", type=int, default=8, help="prompts of the group (rollout size / dp ranks)")
    p.add_argument("--samples", type=int, default=1, help="samples per prompt at 1x")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-len", type=int, default=2048, help="longest sample (prompt + response) in tokens")
    p.add_argument("--micro-batch", type=int, default=4, help="rolloutMicroBatchSize (ours)")
    p.add_argument("--chunks", type=int, default=2, help="chunks per shard (ours)")
    p.add_argument("--long-seq", type=int, default=4096, help="sequence length of the SP1 vs SP2 table")
    p.add_argument(
        "--long-batch", type=int, default=2, help="samples per micro-batch of the SP1 vs SP2 table"
    )
    p.add_argument("--child", choices=[*WAYS, "long"], help=argparse.SUPPRESS)
    p.add_argument("--scale", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        args.way = args.child
        long_child(args) if args.child == "long" else child(args)
        return

    common.print_machine()
    long_model()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    flags = {
        k: getattr(args, k) for k in ("prompts", "samples", "prompt_len", "max_len", "micro_batch", "chunks")
    }
    long_flags = {"long_seq": args.long_seq, "long_batch": args.long_batch}
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for i in range(args.repeats):  # interleaved; order rotated each round
        ways = list(WAYS[i % 3 :] + WAYS[: i % 3])
        for way in ways:
            for scale in SCALES:
                runs.setdefault((way, scale), []).append(
                    common.run_child(__file__, way, scale, flags, env, 1200)
                )
        for sp in (1, 2) if i % 2 == 0 else (2, 1):
            runs.setdefault(("long", sp), []).append(
                common.run_child(__file__, "long", sp, long_flags, env, 1200)
            )

    def med(way: str, scale: int, key: str) -> float:
        return common.median([r[key] for r in runs[(way, scale)]])

    rows = []
    for way in WAYS:
        for scale in SCALES:
            r = runs[(way, scale)][0]
            rows.append([f"{LABEL[way]} x{scale}", int(r["samples"]), int(r["tokens"]), int(r["max_len"]),
                         med(way, scale, "before_mib"), med(way, scale, "peak_mib"), med(way, scale, "added_mib"),
                         med(way, scale, "rank1_added_mib"), med(way, scale, "seconds")])  # fmt: skip
    common.table(
        f"Experience of one SP group (2 gloo ranks, Ulysses), tiny Llama 4k context; {args.prompts} prompts x "
        f"{args.samples}..{args.samples * SCALES[-1]} samples, <= {args.max_len} tokens; medians of {args.repeats}",
        ["way, samples per prompt", "samples", "tokens", "longest", "rank 0 RSS before MiB", "rank 0 peak MiB",
         "rank 0 added MiB", "rank 1 added MiB", "seconds"],
        rows,
    )  # fmt: skip
    growth = {w: med(w, SCALES[-1], "peak_mib") / med(w, SCALES[0], "peak_mib") for w in WAYS}
    added = {w: med(w, SCALES[-1], "added_mib") / max(med(w, SCALES[0], "added_mib"), 1e-9) for w in WAYS}
    common.table(
        f"Rank 0 peak growth, samples per prompt x{SCALES[0]} -> x{SCALES[-1]}",
        ["way", "whole-process peak growth (RESULT)", "added-memory growth"],
        [[LABEL[w], growth[w], added[w]] for w in WAYS],
    )
    common.table(
        f"PPO forward+backward of {args.long_batch} x {args.long_seq} tokens: peak per rank (worst rank), medians",
        ["sequenceParallelSize", "added MiB per rank", "peak RSS MiB", "seconds"],
        [[str(sp), med("long", sp, "added_mib"), med("long", sp, "peak_mib"), med("long", sp, "seconds")] for sp in (1, 2)],
    )  # fmt: skip
    common.result(
        {
            "peak_growth": round(growth["ours"], 3),
            "baseline_peak_growth": round(growth["broadcast"], 3),
            "variant_peak_growth": round(growth["broadcast_micro"], 3),
            "ours_added_mib_1x": round(med("ours", SCALES[0], "added_mib"), 1),
            "ours_added_mib_8x": round(med("ours", SCALES[-1], "added_mib"), 1),
            "baseline_added_mib_1x": round(med("broadcast", SCALES[0], "added_mib"), 1),
            "baseline_added_mib_8x": round(med("broadcast", SCALES[-1], "added_mib"), 1),
            "long_sp1_added_mib": round(med("long", 1, "added_mib"), 1),
            "long_sp2_added_mib": round(med("long", 2, "added_mib"), 1),
        }
    )


if __name__ == "__main__":
    main()
