"""Asynchronous RL end to end: async vs synchronous steps with the engine and the trainer on their own cores,
and vs TRL's GRPOTrainer on both cores, tokens per second (docs/benchmarks.md, issue 19).

The placement stands in for disaggregated GPUs: the vLLM engine process is pinned to core 0 and every
trainer rank process (the ModelRank actors, DeepSpeed ZeRO-3 ranks) to core 1, by CPU affinity on each of
their threads, from outside the trainer, and each side's torch threads are sized for its one core. The
driver, the reward actor and Ray's own processes are not pinned. Ways, in fresh processes, interleaved:
ours synchronous and ours with `algorithm.async.enabled` with that placement, TRL (as e2e_vs_trl.py runs
it) on both cores, and, for reference, ours synchronous unpinned. Same medium model, task, batch and
response length as e2e_vs_trl.py. `overlap_efficiency` = (generation time + training time, each measured
alone with that placement, from the synchronous steps' phases) / (async step time); no overlap can do
better than (g + t) / max(g, t).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

from lib import common, grpo
from lib.grpo import SIZES

MEDIUM = 1
WAYS = ("sync", "async", "trl", "sync_unpinned")  # the last: what the placement costs
# Which Ray worker processes go where: their process titles (Ray names an actor's process `ray::<Class>`,
# then `ray::<Class>.<method>` while a call runs) and the cores they get.
PLACEMENT = {"engine": ("ray::RolloutEngine", {0}), "trainer": ("ray::ModelRank", {1})}


# ------------------------------------------------------------------------------------------- placement


def descendants(root: int) -> dict[int, str]:
    """pid -> process title of every live process below `root` (only this run's Ray, never anyone else's)."""
    parent: dict[int, int] = {}
    title: dict[int, str] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:  # ended meanwhile
            continue
        parent[pid] = int(stat.rsplit(")", 1)[1].split()[1])  # the field after the (comm) is the ppid
        title[pid] = cmdline.replace(b"\0", b" ").decode(errors="replace").strip()
    found = {}
    for pid, name in title.items():
        up, seen = parent.get(pid, 0), set()
        while up > 1 and up not in seen and up != root:
            seen.add(up)
            up = parent.get(up, 0)
        if up == root:
            found[pid] = name
    return found


def threads_of(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


class Pinner:
    """Pins the engine's and the trainer ranks' threads to their cores, polling from the start of the run
    (the actors start, and start threads, at different times); `readback()` says where they are now."""

    def __init__(self, root: int, interval: float = 0.5) -> None:
        self.root, self.interval = root, interval
        self.first_pinned: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="pinner", daemon=True)
        self._thread.start()

    def processes(self) -> dict[int, tuple[str, str, set[int]]]:
        """pid -> (role, title, cores) of this run's engine and rank processes."""
        out = {}
        for pid, title in descendants(self.root).items():
            for role, (prefix, cores) in PLACEMENT.items():
                if title.startswith(prefix):
                    out[pid] = (role, title, cores)
        return out

    def pin_once(self) -> None:
        for pid, (role, _, cores) in self.processes().items():
            for tid in threads_of(pid):
                try:
                    if os.sched_getaffinity(tid) != cores:
                        os.sched_setaffinity(tid, cores)
                except OSError:  # the thread ended
                    continue
            self.first_pinned.setdefault(role, time.perf_counter())

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.pin_once()
            self._stop.wait(self.interval)

    def readback(self) -> list[dict[str, Any]]:
        """Each pinned process: its role, pid, title, threads, and the cores its threads may run on (read
        back from the kernel), with how many threads are not on the role's cores."""
        rows = []
        for pid, (role, title, cores) in sorted(self.processes().items(), key=lambda kv: kv[1][0]):
            allowed: set[int] = set()
            off, tids = 0, threads_of(pid)
            for tid in tids:
                try:
                    mask = os.sched_getaffinity(tid)
                except OSError:
                    continue
                allowed |= mask
                off += mask != cores
            rows.append(
                {
                    "role": role,
                    "pid": pid,
                    "title": title.split()[0],
                    "threads": len(tids),
                    "cores": sorted(allowed),
                    "off_target": off,
                }
            )
        return rows

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def size_threads_for_one_core() -> None:
    """Each side has one core, so size its torch threads for one: the trainer sizes the engine's and the
    ranks' threads in placement.place from os.cpu_count(), which ignores affinity (the engine would run 2
    threads on its 1 core). Only `place` sees 1, in this process; nothing else changes."""
    from unittest import mock

    from rlhf_trainer import driver

    real = getattr(driver, "place")  # noqa: B009 (the driver's own name for it, which the run calls)

    def place_for_one_core(*args: Any, **kwargs: Any) -> Any:
        with mock.patch("os.cpu_count", return_value=1):
            return real(*args, **kwargs)

    setattr(driver, "place", place_for_one_core)  # noqa: B010


# ----------------------------------------------------------------------------------------------- child


def child(way: str, args: argparse.Namespace) -> None:
    size, base = SIZES[MEDIUM], grpo.model_dir(MEDIUM)
    steps = args.warmup + args.steps
    if way == "trl":
        try:
            per_step = grpo.run_trl(size, base, steps, args.warmup)
        except common.BaselineUnavailable as e:
            print(f"BASELINE-UNAVAILABLE {e}", file=sys.stderr, flush=True)
            sys.exit(3)
        print("CHILD " + json.dumps({"steps": per_step}), flush=True)
        return
    grpo.use_private_ray()
    sets = ["algorithm.async.enabled=true"] if way == "async" else []
    # One step more than counted: a run's last step generates nothing ahead (async), so it is no
    # steady-state step; it is not counted on any of our ways.
    manifest = grpo.ours_manifest(base, size, steps + 1, args.ours_ranks, sets)
    if way == "sync_unpinned":
        out: dict[str, Any] = {"steps": grpo.run_ours(manifest, steps + 1)}
    else:
        out = run_pinned(manifest, steps + 1, args)
    out["steps"] = grpo.counted(out["steps"], args.warmup)[: args.steps]
    print("CHILD " + json.dumps(out), flush=True)


def run_pinned(manifest: dict[str, Any], steps: int, args: argparse.Namespace) -> dict[str, Any]:
    """Our trainer with the engine on core 0 and the ranks on core 1; the affinity read back at the first
    and the last step, and how long before the first counted step both sides were pinned."""
    if args.one_core_threads:
        size_threads_for_one_core()
    pinner = Pinner(os.getpid())
    seen: dict[str, Any] = {}

    def on_step(report: Any) -> None:
        pinner.pin_once()  # the engine's and the ranks' threads started since the last poll
        seen.setdefault("first_step", pinner.readback())
        seen["last_step"] = pinner.readback()

    try:
        records = grpo.run_ours(manifest, steps, on_step=on_step)
    finally:
        pinner.stop()
    both = len(pinner.first_pinned) == len(PLACEMENT)
    started = max(pinner.first_pinned.values()) if both else float("nan")
    return {
        "steps": records,
        "pinning": seen,
        "pinned_before_counted_s": records[max(1, args.warmup) - 1]["end"] - started,
    }


# ------------------------------------------------------------------------------------------------ main


def measure(way: str, args: argparse.Namespace) -> dict[str, Any]:
    flags = {
        "warmup": args.warmup,
        "steps": args.steps,
        "ours_ranks": args.ours_ranks,
        "one_core_threads": args.one_core_threads,
    }
    return common.run_child(__file__, way, MEDIUM, flags, dict(os.environ), timeout=1800)


def phase_split(step: dict[str, Any]) -> tuple[float, float]:
    """(generation + reward, every other timed phase) of one of our steps."""
    phases = step["phase_seconds"]
    gen = phases.get("generation", 0.0) + phases.get("reward", 0.0)
    return gen, sum(phases.values()) - gen


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    options = (  # flag, default, help (all integers)
        ("--repeats", 2, "fresh processes per way (interleaved)"),
        ("--warmup", 1, "steps per process not counted (the first: start-up; async generates it in line)"),
        ("--steps", 3, "steps counted per process"),
        ("--ours-ranks", 2, "our actor's ZeRO-3 ranks (processes), on core 1"),
        ("--one-core-threads", 1, "1: engine and rank torch threads sized for one core; 0: os.cpu_count()"),
    )
    for flag, default, text in options:
        p.add_argument(flag, type=int, default=default, help=text)
    p.add_argument("--child", choices=WAYS, help=argparse.SUPPRESS)
    p.add_argument("--scale", type=int, default=MEDIUM, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.child, args)
        return 0
    try:
        import trl
    except ImportError:
        common.fail("TRL is not installed: the baseline cannot run (`make setup` installs trl==1.16.0)")
    if (os.cpu_count() or 1) < 2 or not {0, 1} <= os.sched_getaffinity(0):
        common.fail("the placement needs cores 0 and 1")
    common.print_machine()
    grpo.model_dir(MEDIUM)
    shutil.rmtree(common.BENCH_RAY_TMP, ignore_errors=True)

    runs: dict[str, list[dict[str, Any]]] = {w: [] for w in WAYS}
    for r in range(args.repeats):
        for way in WAYS if r % 2 == 0 else tuple(reversed(WAYS)):
            t0 = time.perf_counter()
            out = measure(way, args)
            runs[way].append(out)
            step_s = common.median([x["seconds"] for x in out["steps"]])
            load = Path("/proc/loadavg").read_text().split()[0]
            common.console.print(
                f"[dim]repeat {r + 1} {way}: {step_s:.2f} s/step, process {time.perf_counter() - t0:.0f} s, "
                f"load average (1 min) at its end {load}[/dim]"
            )
            if way in ("sync", "async"):
                report_pinning(way, r, out)

    def steps_of(way: str) -> list[dict[str, Any]]:
        return [x for out in runs[way] for x in out["steps"]]

    def med(way: str, key: str) -> float:
        return common.median([float(x[key]) for x in steps_of(way)])

    def tps(way: str) -> float:
        return common.median([x["tokens"] / x["seconds"] for x in steps_of(way)])

    # Reward after N steps: the last step of each process (median over processes).
    n_steps = args.warmup + args.steps
    final_reward = {w: common.median([out["steps"][-1]["reward_mean"] for out in runs[w]]) for w in WAYS}

    size = SIZES[MEDIUM]
    gen_alone = common.median([phase_split(x)[0] for x in steps_of("sync")])
    train_alone = common.median([phase_split(x)[1] for x in steps_of("sync")])
    async_step, sync_step, trl_step = med("async", "seconds"), med("sync", "seconds"), med("trl", "seconds")
    overlap = (gen_alone + train_alone) / async_step
    bound = (gen_alone + train_alone) / max(gen_alone, train_alone)
    pinned = (
        "engine core 0, 2 ZeRO-3 ranks core 1"
        if args.ours_ranks == 2
        else f"{args.ours_ranks} rank(s) core 1"
    )
    rows = []
    for way, label, settings in (
        ("sync", "ours synchronous", pinned),
        ("async", "ours async (maxStaleness 1)", pinned),
        ("trl", f"TRL {trl.__version__} GRPOTrainer", "HF generate, 1 process, both cores"),
        ("sync_unpinned", "ours synchronous (reference)", "unpinned: both cores, as e2e_vs_trl"),
    ):
        ours = way != "trl"
        rows.append(
            [
                label,
                settings,
                len(steps_of(way)),
                med(way, "tokens"),
                med(way, "seconds"),
                tps(way),
                med(way, "trainer_idle_ratio") if ours else float("nan"),
                med(way, "rollout_idle_ratio") if ours else float("nan"),
                med(way, "staleness") if ours else float("nan"),
                final_reward[way],
            ]
        )
    common.table(
        f"{size.name} {size.prompts}x{size.samples}, <= {size.response_len} new tokens: medians over "
        f"{args.repeats} interleaved processes x {args.steps} counted steps (after {args.warmup} warm-up); "
        f"reward = the mean reward of step {n_steps}",
        [
            "way",
            "placement",
            "steps",
            "tokens/step",
            "step s",
            "tokens/s",
            "trainer idle",
            "rollout idle",
            "staleness",
            f"reward @{n_steps}",
        ],
        rows,
    )

    profile = []
    for way in ("sync", "async", "sync_unpinned"):
        phases: dict[str, list[float]] = {}
        for x in steps_of(way):
            for k, v in x["phase_seconds"].items():
                phases.setdefault(k, []).append(v)
            phases.setdefault("(outside the phases)", []).append(
                x["seconds"] - sum(x["phase_seconds"].values())
            )
            phases.setdefault("(the engine generating the batch)", []).append(x["generating_seconds"])
        profile += [[way, k, common.median(v)] for k, v in phases.items()]
    for k in ("generate", "generate+score+advantages"):
        profile.append(["trl", k, common.median([x["phase_seconds"][k] for x in steps_of("trl")])])
    profile.append(
        [
            "trl",
            "rest: forward/backward/optimizer",
            common.median(
                [x["seconds"] - x["phase_seconds"]["generate+score+advantages"] for x in steps_of("trl")]
            ),
        ]
    )
    common.table(
        "Where a step's time goes (medians). async: `generation`/`reward` are only the wait for the batch "
        "generated during the last step; (the engine generating the batch) is how long the engine took, "
        "in async off the critical path",
        ["way", "phase", "seconds"],
        profile,
    )

    ratios = {
        "async_vs_sync": tps("async") / tps("sync"),
        "overlap_efficiency": overlap,
        "async_vs_trl": tps("async") / tps("trl"),
    }
    best_async_step = max(gen_alone, train_alone)  # neither side goes faster than alone
    bounds = {
        "async_vs_sync": sync_step / best_async_step,
        "overlap_efficiency": bound,
        "async_vs_trl": med("async", "tokens") / best_async_step / tps("trl"),
    }
    goals = {"async_vs_sync": 1.5, "overlap_efficiency": 1.6, "async_vs_trl": 1.0}
    common.table(
        f"Goals (generation alone g = {gen_alone:.2f} s, training alone t = {train_alone:.2f} s, from the "
        f"synchronous steps' phases with this placement; bound = if the async step took max(g, t))",
        ["goal", "measured", "target", "bound on this machine", "met?"],
        [
            [k, ratios[k], f">= {goals[k]}", bounds[k], "met" if ratios[k] >= goals[k] else "MISSED"]
            for k in goals
        ],
    )
    common.result(
        {
            "async_vs_sync": round(ratios["async_vs_sync"], 3),
            "overlap_efficiency": round(overlap, 3),
            "async_vs_trl": round(ratios["async_vs_trl"], 3),
            "overlap_bound": round(bound, 3),
            "generation_alone_s": round(gen_alone, 3),
            "training_alone_s": round(train_alone, 3),
            "sync_step_s": round(sync_step, 3),
            "async_step_s": round(async_step, 3),
            "trl_step_s": round(trl_step, 3),
            "sync_tokens_per_s": round(tps("sync"), 1),
            "async_tokens_per_s": round(tps("async"), 1),
            "trl_tokens_per_s": round(tps("trl"), 1),
            "sync_unpinned_step_s": round(med("sync_unpinned", "seconds"), 3),
            "async_vs_sync_unpinned": round(tps("async") / tps("sync_unpinned"), 3),
            "async_trainer_idle": round(med("async", "trainer_idle_ratio"), 3),
            "async_rollout_idle": round(med("async", "rollout_idle_ratio"), 3),
            "sync_trainer_idle": round(med("sync", "trainer_idle_ratio"), 3),
            "sync_rollout_idle": round(med("sync", "rollout_idle_ratio"), 3),
            "reward_after_steps": n_steps,
            "reward": {w: round(final_reward[w], 4) for w in WAYS},
        }
    )
    return 0


def report_pinning(way: str, repeat: int, out: dict[str, Any]) -> None:
    """Print where the engine's and the ranks' threads were allowed to run, read back from the kernel at the
    first and the last step; a run whose processes were not all on their cores is not a measurement."""
    rows = []
    for when in ("first_step", "last_step"):
        for proc in out["pinning"].get(when, []):
            rows.append(
                [
                    when,
                    proc["role"],
                    proc["title"],
                    proc["pid"],
                    proc["threads"],
                    ",".join(map(str, proc["cores"])),
                    proc["off_target"],
                ]
            )
    common.table(
        f"repeat {repeat + 1} {way}: affinity read back (pinned {out['pinned_before_counted_s']:.0f} s before "
        "the first counted step)",
        ["at", "role", "process", "pid", "threads", "cores", "threads off their core"],
        rows,
    )
    roles = {p["role"] for when in ("first_step", "last_step") for p in out["pinning"].get(when, [])}
    wrong = sum(p["off_target"] for p in out["pinning"].get("last_step", []))
    if roles != set(PLACEMENT) or wrong or not out["pinned_before_counted_s"] > 0:
        common.fail(
            f"{way}: the placement did not hold (roles {sorted(roles)}, {wrong} threads off their core)"
        )


if __name__ == "__main__":
    sys.exit(main())
