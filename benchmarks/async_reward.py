"""Asynchronous vs blocking reward, with a 50 ms-per-sample reward function (docs/benchmarks.md, issues 8, 19).

Ours is the trainer's real path: the trainer's `ChunkDispatcher` streams chunks out of a real vLLM engine
actor and hands each finished request to the real `RewardScorer` actor at once, which scores its samples
in sub-batches over its threads; the reward on the step's critical path is what is still running when
generation ends (loop.py's `reward` phase). The baseline is what TRL's GRPOTrainer and OpenRLHF do by
default: generate the whole batch, then score it in one blocking call. A variant scores the whole batch
after generation in sub-batches over the same threads: what sub-batching alone gives, without streaming.
All use the same engine, prompts and sampling, interleaved.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from lib import common

SLOW_REWARD = Path(__file__).resolve().parent / "lib" / "slow_reward.py"


def build(tiny: Path, args: argparse.Namespace) -> SimpleNamespace:
    """A real engine actor and a real reward-scorer actor, plus what the chunk dispatcher is given
    (the pool's ready engines, the sampling settings, the reward scorer)."""
    import ray
    from prometheus_client import CollectorRegistry
    from rlhf_trainer.metrics import TrainerExporter
    from rlhf_trainer.rollout.engine import RolloutEngine
    from rlhf_trainer.workers.reward import RewardScorer

    options = {
        "model_path": str(tiny / "model"),
        "device": "cpu",
        "seed": 0,
        "chat_template": False,
        "max_model_len": args.prompt_len + args.response_len + 8,
        "tensor_parallel_size": 1,
        "threads": os.cpu_count() or 1,
        "dtype": "float32",
    }
    engine = ray.remote(RolloutEngine).options(num_cpus=1).remote(0, options)

    def scorer(concurrency: int) -> Any:
        spec = {
            "type": "function",
            "function": f"{SLOW_REWARD}:reward",
            "timeout_seconds": 120.0,
            "concurrency": concurrency,
        }
        actor = ray.remote(RewardScorer).options(num_cpus=0.5, max_concurrency=concurrency + 1)
        return actor.remote(spec, "cpu")

    scorers = {"threads": scorer(args.concurrency), "one_call": scorer(1)}  # one call: one thread
    ray.get([engine.ready.remote(), *[s.ready.remote() for s in scorers.values()]])
    slot = SimpleNamespace(index=0, handle=engine)
    return SimpleNamespace(
        pool=SimpleNamespace(ready=lambda: [slot]),
        algo=SimpleNamespace(
            samples_per_prompt=args.samples,
            max_response_length=args.response_len,
            max_prompt_length=args.prompt_len,
        ),
        spec=SimpleNamespace(rollout=SimpleNamespace(temperature=1.0, top_p=1.0)),
        reward=scorers["threads"],
        blocking_reward=scorers,
        metrics=TrainerExporter("bench", registry=CollectorRegistry()),
        job="bench",
        engine=engine,
    )


class HandOffClock:
    """The scorer handle the dispatcher is given, noting when each finished request is handed over."""

    def __init__(self, scorer: Any) -> None:
        self.scorer = scorer
        self.assemble = scorer.assemble
        self.score_request = self
        self.times: list[float] = []

    def remote(self, request_ref: Any, columns: Any = None) -> Any:
        self.times.append(time.perf_counter())
        return self.scorer.score_request.remote(request_ref, columns)


def run_ours(t: Any, prompts: list[str], ranks: int) -> dict[str, float]:
    """loop.py's `generation` + `reward` phases, through the trainer's own ChunkDispatcher."""
    import ray
    from rlhf_trainer.rollout.dispatch import ChunkDispatcher
    from rlhf_trainer.transfer import plan_chunks

    chunks = plan_chunks(len(prompts), ranks, 1)
    sampling = {
        "n": t.algo.samples_per_prompt,
        "temperature": t.spec.rollout.temperature,
        "top_p": t.spec.rollout.top_p,
        "max_tokens": t.algo.max_response_length,
        "max_prompt_tokens": t.algo.max_prompt_length,
    }

    def engine_lost(slot: Any, err: BaseException) -> None:
        raise RuntimeError(f"benchmark engine {slot.index} lost: {err}")

    clock = HandOffClock(t.reward)
    t0 = time.perf_counter()
    dispatcher = ChunkDispatcher(0, t.pool.ready(), clock, sampling, engine_lost)
    rollout = dispatcher.run(chunks, prompts, [None] * len(prompts))
    metas, reward_calls = rollout.metas, rollout.reward_calls
    t1 = time.perf_counter()
    reward_metas = ray.get([m for m, _ in reward_calls])
    t2 = time.perf_counter()
    return {
        "generation_s": t1 - t0,
        "critical_s": t2 - t1,
        "serial_s": sum(m.seconds for m in reward_metas),
        "step_s": t2 - t0,
        # requests handed to the scorer in the last 10 % of generation: their scoring can hardly overlap it
        "late_requests": sum(h > t1 - 0.1 * (t1 - t0) for h in clock.times) / len(clock.times),
        "chunks": len(chunks),
        "samples": sum(m.samples for m in metas),
        "tokens": sum(m.response_tokens for m in metas),
        "errors": sum(m.errors for m in reward_metas),
    }


def run_blocking(t: Any, prompts: list[str], ranks: int, scorer: str) -> dict[str, float]:
    """Generate everything, fetch it, then score the whole batch: in one blocking call (TRL/OpenRLHF)
    with the `one_call` scorer, or in sub-batches over its threads with the `threads` one."""
    import ray
    from rlhf_trainer.transfer import PackedRollout, plan_chunks

    sampling = {
        "n": t.algo.samples_per_prompt,
        "temperature": 1.0,
        "top_p": 1.0,
        "max_tokens": t.algo.max_response_length,
        "max_prompt_tokens": t.algo.max_prompt_length,
    }
    chunks = plan_chunks(len(prompts), ranks, 1)
    batch = [
        {"chunk": c, "shard": s, "prompts": [prompts[i] for i in idx], "groups": idx, "labels": []}
        for c, (s, _, idx) in enumerate(chunks)
    ]
    t0 = time.perf_counter()
    refs = list(t.engine.generate_chunks.options(num_returns="streaming").remote(batch, sampling))
    parts = [p for p in ray.get(refs) if isinstance(p, PackedRollout)]
    whole = PackedRollout.concat(parts)
    t1 = time.perf_counter()
    meta, _ = ray.get(t.blocking_reward[scorer].score.options(num_returns=2).remote(0, whole))
    t2 = time.perf_counter()
    return {
        "generation_s": t1 - t0,
        "critical_s": t2 - t1,
        "serial_s": t2 - t1,
        "step_s": t2 - t0,
        "chunks": 1,
        "samples": whole.num_samples,
        "tokens": int(whole.response_lens.sum()),
        "errors": meta.errors,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--prompts", type=int, default=16, help="prompts per step (rolloutBatchSize)")
    p.add_argument("--samples", type=int, default=8, help="samples per prompt")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--response-len", type=int, default=128)
    p.add_argument("--ranks", type=int, default=2, help="actor ranks (shards), as in examples/rlhfjob-tiny")
    p.add_argument("--concurrency", type=int, default=16, help="model.reward.concurrency (spec default)")
    args = p.parse_args()

    common.print_machine()
    tiny = common.tiny_model()
    common.start_ray()
    from rlhf_trainer.data import PromptDataset

    data = PromptDataset(str(tiny / "prompts.jsonl"), "prompt", None, 0)
    t = build(tiny, args)
    prompts = [str(p) for p in data.next_batch(args.prompts).prompts]
    ways = {
        "ours": lambda ps: run_ours(t, ps, args.ranks),
        "blocking_threads": lambda ps: run_blocking(t, ps, args.ranks, "threads"),
        "blocking": lambda ps: run_blocking(t, ps, args.ranks, "one_call"),
    }
    # Warm-up: first generation compiles/allocates; first reward call imports the function.
    for way in ways.values():
        way(prompts)

    runs: dict[str, list[dict[str, float]]] = {name: [] for name in ways}
    order = list(ways)
    for i in range(args.repeats):  # interleaved, order rotated each round
        prompts = [str(p) for p in data.next_batch(args.prompts).prompts]
        for name in order[i % len(order) :] + order[: i % len(order)]:
            runs[name].append(ways[name](prompts))
    for name, rs in runs.items():
        if rs and any(r["errors"] for r in rs):
            common.fail(f"{name}: the reward reported errors; numbers would be meaningless")
    if not runs["blocking"]:
        common.fail("the blocking baseline did not run")

    def med(name: str, key: str) -> float:
        return common.median([r[key] for r in runs[name]])

    serial = med("blocking", "serial_s")
    labels = {
        "ours": "ours: per-request streaming, sub-batched",
        "blocking_threads": f"variant: blocking, sub-batched over {args.concurrency} threads",
        "blocking": "baseline: blocking, one call (TRL/OpenRLHF default)",
    }
    rows = []
    for name, rs in runs.items():
        if not rs:
            continue
        rows.append(
            [
                labels[name],
                int(rs[0]["chunks"]),
                int(rs[0]["samples"]),
                med(name, "tokens"),
                med(name, "generation_s"),
                med(name, "serial_s"),
                med(name, "critical_s"),
                med(name, "critical_s") / serial,
                med(name, "step_s"),
            ]
        )
    common.table(
        f"Reward on the critical path: {args.prompts} prompts x {args.samples} samples, <= {args.response_len} "
        f"tokens, 50 ms/sample, concurrency {args.concurrency}; medians of {args.repeats} interleaved runs; "
        "1 vLLM engine (real), RewardScorer actor (real)",
        [
            "way",
            "chunks",
            "samples",
            "response tokens",
            "generation s",
            "scoring s (scorer's own)",
            "reward on critical path s",
            "fraction of serial",
            "gen+reward s",
        ],
        rows,
    )
    common.result(
        {
            "critical_path_fraction": round(med("ours", "critical_s") / serial, 4),
            "ours_critical_s": round(med("ours", "critical_s"), 3),
            "baseline_serial_s": round(serial, 3),
            "ours_step_s": round(med("ours", "step_s"), 3),
            "baseline_step_s": round(med("blocking", "step_s"), 3),
            "ours_generation_s": round(med("ours", "generation_s"), 3),
            "baseline_generation_s": round(med("blocking", "generation_s"), 3),
            "blocking_threads_fraction": round(med("blocking_threads", "critical_s") / serial, 4),
            "ours_late_requests": round(med("ours", "late_requests"), 3),
            "generation_s_runs": {n: [round(r["generation_s"], 2) for r in rs] for n, rs in runs.items()},
        }
    )


if __name__ == "__main__":
    sys.exit(main())
