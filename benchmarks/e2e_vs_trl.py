"""End to end: our GRPO step vs TRL's GRPOTrainer, tokens per second (docs/benchmarks.md, issue 8).

Same model, reward (the tiny task's vowel share), prompt set, batch (prompts x samples per prompt), max
new tokens, temperature 1, one epoch (one optimizer update) per step, fp32, no KL term (TRL's default
beta=0 loads no reference; ours with klCoef=0 places none), on the same 2 cores. Ours is `driver.run`,
the real trainer (Ray, DeepSpeed ZeRO-3 ranks over gloo, a vLLM CPU engine, the reward actor); TRL is
`GRPOTrainer` with HF `generate`, as a CPU user runs it. Tokens per step = prompt + generated tokens,
counted on each side; step time = wall time between consecutive step ends, after warm-up steps.
Each run is a fresh process; ours and TRL alternate. Two sizes: the tiny model (fixed costs dominate)
and a ~20M-parameter model with 128-token responses (compute dominates), which gives the RESULT.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from typing import Any

from lib import common, grpo
from lib.grpo import SIZES

# ----------------------------------------------------------------------------------------------- main


def child(way: str, scale: int, args: argparse.Namespace) -> None:
    size = SIZES[scale]
    base = grpo.model_dir(scale)
    steps = args.warmup + (args.steps or size.steps)
    if way == "ours":
        grpo.use_private_ray()
        manifest = grpo.ours_manifest(base, size, steps, ranks_for(args, scale))
        per_step = grpo.counted(grpo.run_ours(manifest, steps), args.warmup)
    else:
        try:
            per_step = grpo.run_trl(size, base, steps, args.warmup, use_vllm=bool(args.trl_vllm))
        except common.BaselineUnavailable as e:
            print(f"BASELINE-UNAVAILABLE {e}", file=sys.stderr, flush=True)
            sys.exit(3)
    print("CHILD " + json.dumps({"steps": per_step}), flush=True)


def ranks_for(args: argparse.Namespace, scale: int) -> int:
    """Our actor's ranks at this size: `--ours-ranks` is one count for every size or one per size."""
    counts = [int(x) for x in str(args.ours_ranks).split(",") if x.strip()]
    return counts[min(scale, len(counts) - 1)]


def trl_vllm_sizes(args: argparse.Namespace) -> set[int]:
    return {int(x) for x in str(args.trl_vllm_sizes).split(",") if x.strip()}


def measure(way: str, scale: int, args: argparse.Namespace) -> dict[str, Any]:
    flags = {"warmup": args.warmup, "steps": args.steps or 0, "ours_ranks": args.ours_ranks}
    if scale in trl_vllm_sizes(args):
        flags["trl_vllm"] = 1
    return common.run_child(__file__, way, scale, flags, dict(os.environ), timeout=900)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=2, help="fresh processes per way and size (interleaved)")
    p.add_argument("--warmup", type=int, default=1, help="steps per process not counted")
    p.add_argument("--steps", type=int, default=0, help="steps counted per process (0: the size's default)")
    p.add_argument("--sizes", default="0,1", help="which sizes: 0 tiny, 1 medium (the RESULT)")
    p.add_argument(
        "--ours-ranks",
        default="2,1",
        help="our actor's ZeRO-3 ranks (processes): one count, or one per size (tiny,medium); the default is "
        "each size's fastest measured on 2 cores (docs/benchmarks.md)",
    )
    p.add_argument("--trl-vllm", type=int, default=0, help=argparse.SUPPRESS)  # set per size by the parent
    p.add_argument(
        "--trl-vllm-sizes", default="", help="sizes where TRL generates with vLLM colocate (else HF generate)"
    )
    p.add_argument("--child", choices=["ours", "trl"], help=argparse.SUPPRESS)
    p.add_argument("--scale", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.child, args.scale, args)
        return 0
    try:
        import trl
    except ImportError:
        common.fail("TRL is not installed: the baseline cannot run (`make setup` installs trl==1.16.0)")
    common.print_machine()
    sizes = [int(s) for s in args.sizes.split(",")]
    if 1 not in sizes:
        common.fail("the RESULT comes from size 1 (medium): include it in --sizes")
    for s in sizes:
        grpo.model_dir(s)
    shutil.rmtree(common.BENCH_RAY_TMP, ignore_errors=True)

    runs: dict[tuple[str, int], list[dict[str, Any]]] = {(w, s): [] for w in ("ours", "trl") for s in sizes}
    for r in range(args.repeats):
        for s in sizes:
            order = ["ours", "trl"] if r % 2 == 0 else ["trl", "ours"]
            for way in order:
                t0 = time.perf_counter()
                out = measure(way, s, args)
                runs[(way, s)].append(out)
                med = common.median([x["seconds"] for x in out["steps"]])
                common.console.print(
                    f"[dim]repeat {r + 1} {SIZES[s].name} {way}: {med:.2f} s/step, "
                    f"process {time.perf_counter() - t0:.0f} s[/dim]"
                )

    def steps_of(way: str, s: int) -> list[dict[str, Any]]:
        return [x for out in runs[(way, s)] for x in out["steps"]]

    def tps(way: str, s: int) -> float:
        return common.median([x["tokens"] / x["seconds"] for x in steps_of(way, s)])

    rows = []
    for s in sizes:
        size = SIZES[s]
        for way in ("ours", "trl"):
            st = steps_of(way, s)
            used = (
                f"{ranks_for(args, s)} ZeRO-3 rank(s) + 1 vLLM engine, fp32"
                if way == "ours"
                else f"{'vLLM colocate' if s in trl_vllm_sizes(args) else 'HF generate'}, 1 process, fp32"
            )
            rows.append(
                [
                    f"{size.name} {size.prompts}x{size.samples}, <= {size.response_len} new",
                    "ours" if way == "ours" else f"TRL {trl.__version__}",
                    used,
                    len(st),
                    common.median([x["tokens"] for x in st]),
                    common.median([x["seconds"] for x in st]),
                    tps(way, s),
                    common.median([x["reward_mean"] for x in st]),
                ]
            )
    common.table(
        f"GRPO step throughput, medians over {args.repeats} interleaved processes x the counted steps "
        f"(after {args.warmup} warm-up step(s)); tokens = prompt + generated",
        ["size", "trainer", "settings", "steps", "tokens/step", "step s", "tokens/s", "reward"],
        rows,
    )
    profile = []
    for way in ("ours", "trl"):
        phases: dict[str, list[float]] = {}
        for x in steps_of(way, 1):
            rest = x["seconds"]
            for k, v in x["phase_seconds"].items():
                phases.setdefault(k, []).append(v)
                if k != "generate":  # nested inside generate+score+advantages
                    rest -= v
            phases.setdefault(
                "rest of the step" if way == "ours" else "rest: forward/backward/optimizer", []
            ).append(rest)
        profile += [[way, k, common.median(v)] for k, v in phases.items()]
    common.table(
        f"{SIZES[1].name}: where a step's time goes (medians; TRL's 'generate' is inside its generate+score block)",
        ["trainer", "phase", "seconds"],
        profile,
    )
    values: dict[str, Any] = {
        "tokens_per_s_ratio": round(tps("ours", 1) / tps("trl", 1), 3),
        "ours_tokens_per_s": round(tps("ours", 1), 1),
        "trl_tokens_per_s": round(tps("trl", 1), 1),
        "ours_step_s": round(common.median([x["seconds"] for x in steps_of("ours", 1)]), 3),
        "trl_step_s": round(common.median([x["seconds"] for x in steps_of("trl", 1)]), 3),
    }
    if 0 in sizes:
        values["tiny_tokens_per_s_ratio"] = round(tps("ours", 0) / tps("trl", 0), 3)
    common.result(values)
    return 0


if __name__ == "__main__":
    sys.exit(main())
