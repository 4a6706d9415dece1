"""Does asynchronous RL learn as well as synchronous? The tiny task, GRPO, synchronous vs
`algorithm.async` (maxStaleness 1), the same steps and seeds (docs/trainer.md, issue 19).

examples/rlhfjob-tiny.yaml as GRPO (the trainer tests' overrides), no checkpoints, on both cores (no
placement: this compares what is learned, not speed). Each (way, seed) is a fresh process; the two ways
alternate within a seed. A step's reward is the mean reward of the samples it trained on; the final reward
of a run is the mean of its last steps. The claim holds when the two ways' final rewards (mean over seeds)
differ by no more than twice the standard error of that difference.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import time
from typing import Any

from lib import common, grpo

mean = statistics.fmean  # the standard library's, for the curves and the final rewards

WAYS = ("sync", "async")


def child(way: str, args: argparse.Namespace) -> None:
    grpo.use_private_ray()
    sets = [f"algorithm.totalSteps={args.steps}", f"algorithm.seed={args.seed}"]
    if way == "async":
        sets += ["algorithm.async.enabled=true", "algorithm.async.maxStaleness=1"]
    records = grpo.run_ours(grpo.tiny_manifest(common.tiny_model(), sets), args.steps)
    keep = ("step", "reward_mean", "staleness", "stale_samples", "valid_samples", "trainer_idle_ratio")
    steps = [{k: r[k] for k in keep} | {"training": r["training"]} for r in records]
    print("CHILD " + json.dumps({"steps": steps}), flush=True)


def measure(way: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    flags = {"steps": args.steps, "seed": seed}
    return common.run_child(__file__, way, 0, flags, dict(os.environ), timeout=1200)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", default="1,2,3", help="algorithm.seed of each pair of runs")
    p.add_argument("--steps", type=int, default=20, help="steps per run (both ways)")
    p.add_argument("--last", type=int, default=5, help="the final reward is the mean of this many last steps")
    p.add_argument("--child", choices=WAYS, help=argparse.SUPPRESS)
    p.add_argument("--scale", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.child, args)
        return 0
    seeds = [int(s) for s in args.seeds.split(",")]
    if len(seeds) < 2 or args.steps < 2 * args.last:
        common.fail("need at least 2 seeds (a spread) and steps >= 2 x --last (a start and an end)")
    common.print_machine()
    common.tiny_model()
    shutil.rmtree(common.BENCH_RAY_TMP, ignore_errors=True)

    curves: dict[str, dict[int, list[float]]] = {w: {} for w in WAYS}
    staleness: dict[str, list[int]] = {w: [] for w in WAYS}
    for i, seed in enumerate(seeds):
        for way in WAYS if i % 2 == 0 else tuple(reversed(WAYS)):
            t0 = time.perf_counter()
            out = measure(way, seed, args)
            curves[way][seed] = [s["reward_mean"] for s in out["steps"]]
            staleness[way] += [s["staleness"] for s in out["steps"]]
            stale = sum(s["stale_samples"] for s in out["steps"])
            common.console.print(
                f"[dim]seed {seed} {way}: {len(out['steps'])} steps in {time.perf_counter() - t0:.0f} s, "
                f"final {mean(curves[way][seed][-args.last :]):.4f}, stale samples put aside {stale}[/dim]"
            )

    rows = []
    for k in range(args.steps):
        row: list[Any] = [k + 1]
        for seed in seeds:
            row += [curves[w][seed][k] for w in WAYS]
        row += [mean([curves[w][s][k] for s in seeds]) for w in WAYS]
        rows.append(row)
    common.table(
        "Mean reward per step (the samples trained on at that step)",
        ["step", *[f"{w} s{seed}" for seed in seeds for w in WAYS], *[f"{w} mean" for w in WAYS]],
        rows,
    )

    first = {w: {s: mean(curves[w][s][: args.last]) for s in seeds} for w in WAYS}
    final = {w: {s: mean(curves[w][s][-args.last :]) for s in seeds} for w in WAYS}
    final_mean = {w: mean(list(final[w].values())) for w in WAYS}
    spread = {w: statistics.stdev(final[w].values()) for w in WAYS}
    difference = final_mean["async"] - final_mean["sync"]
    noise = math.sqrt(sum(spread[w] ** 2 / len(seeds) for w in WAYS))  # standard error of the difference
    common.table(
        f"Final reward = mean of the last {args.last} of {args.steps} steps; start = mean of the first "
        f"{args.last}; spread = standard deviation over {len(seeds)} seeds",
        ["way", *[f"final s{s}" for s in seeds], "final mean", "spread", "start mean", "rise", "staleness"],
        [
            [
                w,
                *[final[w][s] for s in seeds],
                final_mean[w],
                spread[w],
                mean(list(first[w].values())),
                final_mean[w] - mean(list(first[w].values())),
                f"{min(staleness[w])}-{max(staleness[w])}",
            ]
            for w in WAYS
        ],
    )
    within = abs(difference) <= 2 * noise
    common.console.print(
        f"async - sync = {difference:+.4f}; standard error of the difference {noise:.4f}: "
        + ("within noise (|difference| <= 2 x standard error)" if within else "NOT within noise")
    )
    common.result(
        {
            "final_reward_sync": round(final_mean["sync"], 4),
            "final_reward_async": round(final_mean["async"], 4),
            "difference": round(difference, 4),
            "seed_spread": {w: round(spread[w], 4) for w in WAYS},
            "difference_standard_error": round(noise, 4),
            "within_noise": within,
            "start_reward": {w: round(mean(list(first[w].values())), 4) for w in WAYS},
            "curves_mean": {
                w: [round(mean([curves[w][s][k] for s in seeds]), 4) for k in range(args.steps)] for w in WAYS
            },
            "steps": args.steps,
            "seeds": seeds,
        }
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
