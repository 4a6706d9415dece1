"""Overlapped against one-at-a-time experience forwards and trainings (docs/benchmarks.md, issue 39).

A PPO job on the tiny model (examples/rlhfjob-tiny.yaml: gae with a critic, klCoef > 0, 2 epochs, so
all three experience forwards run) with the actor, the critic and the reference each in a group of its
own (`trainer.colocateActorRef: false`; one rank each), run by `driver.run` in this process on a private
local Ray with the CPU stand-in. The steps alternate, in the same run: the baseline
(RLHF_SEQUENTIAL_PHASES=1: reference, critic values, old log-probs, actor training, critic training one
after the other, as before) and ours (the three forwards at once, then the two trainings at once). Step
time = wall time between consecutive step ends, after warm-up steps; the experience and training blocks'
wall times are timed around `overlap.run_phases`; the phases' own seconds come from the step report.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import yaml
from lib import common, grpo

FORWARDS = ("reference", "critic_values", "old_logprobs")
TRAININGS = ("actor_train", "critic_train")
MODES = ("sequential", "overlapped")


def manifest(steps: int) -> dict[str, Any]:
    """The tiny PPO example, one rank per role, every role in its own group, no checkpoints."""
    from rlhf_trainer.cli import apply_overrides

    base = common.tiny_model()
    sets = [
        f"model.actor={base}/model",
        f"model.critic={base}/model",
        f"data.prompts={base}/prompts.jsonl",
        "checkpoint.path=null",
        f"algorithm.totalSteps={steps}",
        "trainer.actor.gpusPerNode=1",
        "trainer.critic.gpusPerNode=1",
        "trainer.colocateActorRef=false",
        "rollout.engines=1",
    ]
    return dict(apply_overrides(yaml.safe_load(grpo.EXAMPLE.read_text()), sets))


def mode_of(step: int, warmup: int) -> str:
    """Counted steps alternate, the baseline first; warm-up steps alternate the same way."""
    return MODES[(step - warmup - 1) % 2]


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every step of one run: its mode, the driver's step summary, `end` and the blocks' wall times."""
    from rlhf_trainer import loop, overlap

    steps = args.warmup + 2 * args.steps
    blocks: list[tuple[tuple[str, ...], float]] = []  # (phases, wall seconds) of this step's run_phases
    real = overlap.run_phases

    def timed(timer: Any, works: Any) -> dict[str, list[Any]]:
        t0 = time.perf_counter()
        try:
            return real(timer, works)
        finally:
            blocks.append((tuple(w.phase for w in works), time.perf_counter() - t0))

    loop.run_phases = timed  # type: ignore[attr-defined]  # measure only: the trainer's own code runs
    walls: list[dict[str, float]] = []

    def on_step(report: Any) -> None:
        wall = {"experience": 0.0, "training": 0.0}
        for phases, seconds in blocks:
            wall["experience" if phases and phases[0] in FORWARDS else "training"] += seconds
        walls.append(wall)
        blocks.clear()
        mode = mode_of(report.step, args.warmup)
        common.console.print(
            f"[dim]step {report.step}/{steps} {mode}{' (warm-up)' if report.step <= args.warmup else ''}: "
            f"experience {wall['experience']:.2f} s, training {wall['training']:.2f} s[/dim]"
        )
        os.environ[overlap.SEQUENTIAL_ENV] = "1" if mode_of(report.step + 1, args.warmup) == MODES[0] else "0"

    os.environ[overlap.SEQUENTIAL_ENV] = "1" if mode_of(1, args.warmup) == MODES[0] else "0"
    grpo.use_private_ray()
    records = grpo.run_ours(manifest(steps), steps, on_step=on_step)
    out = []
    for i, r in enumerate(records):
        if r["step"] <= args.warmup or i == 0:
            continue
        out.append(
            {
                **r,
                **walls[i],
                "mode": mode_of(r["step"], args.warmup),
                "seconds": r["end"] - records[i - 1]["end"],
            }
        )
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--warmup", type=int, default=2, help="steps not counted (model loading, first compiles)")
    p.add_argument("--steps", type=int, default=5, help="counted steps per mode (they alternate)")
    args = p.parse_args()
    if args.warmup < 1:
        common.fail("--warmup must be at least 1 (the first step's start is unknown)")
    common.print_machine()
    t0 = time.perf_counter()
    counted = run(args)
    common.console.print(f"[dim]run: {time.perf_counter() - t0:.0f} s[/dim]")

    def med(mode: str, key: str) -> float:
        xs = [s for s in counted if s["mode"] == mode]
        if key in ("seconds", "experience", "training"):
            return common.median([s[key] for s in xs])
        return common.median([s["phase_seconds"].get(key, 0.0) for s in xs])

    rows = []
    keys = [
        ("generation", "generation"),
        ("reward", "reward"),
        *[(k, k) for k in FORWARDS],
        ("experience", "experience block (wall)"),
        ("advantages", "advantages"),
        *[(k, k) for k in TRAININGS],
        ("training", "training block (wall)"),
        ("weight_sync", "weight_sync"),
        ("seconds", "step"),
    ]
    for key, label in keys:
        seq, ovl = med("sequential", key), med("overlapped", key)
        rows.append([label, seq, ovl, seq / ovl if ovl > 0 else float("nan")])
    n = {m: sum(1 for s in counted if s["mode"] == m) for m in MODES}
    common.table(
        f"PPO on the tiny model, actor / critic / reference in their own groups (1 rank each); medians of "
        f"{n['sequential']} sequential and {n['overlapped']} overlapped steps, alternating, after "
        f"{args.warmup} warm-up step(s); seconds",
        ["phase", "sequential s", "overlapped s", "sequential / overlapped"],
        rows,
    )
    seq_step, ovl_step = med("sequential", "seconds"), med("overlapped", "seconds")
    common.result(
        {
            "overlap_speedup": round(seq_step / ovl_step, 3),
            "sequential_step_s": round(seq_step, 3),
            "overlapped_step_s": round(ovl_step, 3),
            "sequential_experience_s": round(med("sequential", "experience"), 3),
            "overlapped_experience_s": round(med("overlapped", "experience"), 3),
            "sequential_training_s": round(med("sequential", "training"), 3),
            "overlapped_training_s": round(med("overlapped", "training"), 3),
            "steps_per_mode": min(n.values()),
        }
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
