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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from lib import common

EXAMPLE = common.ROOT / "examples" / "rlhfjob-tiny.yaml"
REWARD = "rlhf_trainer.tasks.tiny:reward"
MEDIUM_DIR = Path(os.environ.get("RLHF_BENCH_MEDIUM", "/tmp/rlhf-bench-e2e-medium"))


@dataclass(frozen=True)
class Size:
    name: str
    prompts: int  # rolloutBatchSize
    samples: int  # samplesPerPrompt
    response_len: int  # max new tokens
    micro_batch: int  # trainMicroBatchSize = TRL per_device_train_batch_size
    steps: int  # steps counted per process (after warm-up)


SIZES = (
    Size("tiny (0.4M params)", prompts=16, samples=8, response_len=32, micro_batch=32, steps=4),
    Size("medium (21M params)", prompts=8, samples=8, response_len=128, micro_batch=32, steps=2),
)


def model_dir(scale: int) -> Path:
    """scale 0: the shared tiny model; 1: the same tokenizer and prompts, a 6-layer 512-wide Llama."""
    if scale == 0:
        return common.tiny_model()
    if not (MEDIUM_DIR / "model" / "config.json").is_file():
        from rlhf_trainer.tiny_model import TinyModelShape, make_tiny_model

        shape = TinyModelShape(
            hidden_size=512, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=8
        )
        make_tiny_model(MEDIUM_DIR, shape=shape)
    return MEDIUM_DIR


def prompt_tokens(tokenizer: Any, prompts: list[str]) -> int:
    return sum(len(tokenizer(p)["input_ids"]) for p in prompts)


# ----------------------------------------------------------------------------------------------- ours


def ours_manifest(base: Path, size: Size, steps: int, ranks: int) -> dict[str, Any]:
    """The tiny example as GRPO (no critic), no KL, one epoch, no checkpoints, this size."""
    from rlhf_trainer.cli import apply_overrides

    manifest = yaml.safe_load(EXAMPLE.read_text())
    sets = [
        f"model.actor={base}/model",
        "model.critic=null",
        "trainer.critic=null",
        f"model.reward.function={REWARD}",
        f"data.prompts={base}/prompts.jsonl",
        "algorithm.advantageEstimator=grpo",
        "algorithm.klCoef=0",
        "algorithm.epochs=1",
        f"algorithm.totalSteps={steps}",
        f"algorithm.samplesPerPrompt={size.samples}",
        f"algorithm.rolloutBatchSize={size.prompts}",
        f"algorithm.maxResponseLength={size.response_len}",
        f"algorithm.trainMicroBatchSize={size.micro_batch}",
        f"algorithm.rolloutMicroBatchSize={size.micro_batch}",
        f"trainer.actor.gpusPerNode={ranks}",
        "rollout.engines=1",
        "rollout.temperature=1.0",
        "checkpoint.path=null",
    ]
    return dict(apply_overrides(manifest, sets))


def child_ours(size: Size, base: Path, args: argparse.Namespace) -> dict[str, Any]:
    from rlhf_trainer.config import parse_spec, preflight
    from rlhf_trainer.data import PromptDataset
    from rlhf_trainer.driver import run
    from transformers import AutoTokenizer

    steps = args.warmup + (args.steps or size.steps)
    spec = parse_spec(ours_manifest(base, size, steps, args.ours_ranks))
    preflight(spec)
    tok = AutoTokenizer.from_pretrained(str(base / "model"))
    batches: list[int] = []

    class RecordingDataset(PromptDataset):
        """The driver's dataset, also counting each step's prompt tokens (x samples per prompt)."""

        def next_batch(self, n: int) -> tuple[list[str], list[Any]]:
            prompts, labels = super().next_batch(n)
            batches.append(prompt_tokens(tok, prompts) * size.samples)
            return prompts, labels

    d = spec.data
    data = RecordingDataset(d.prompts, d.input_key, d.label_key, spec.algorithm.seed)
    ends: list[float] = []
    reports: list[Any] = []

    def on_step(report: Any) -> None:
        ends.append(time.perf_counter())
        reports.append(report)

    run(spec, "bench", steps=steps, metrics_port=0, on_step=on_step, log=lambda m: None, data=data)
    per_step = [
        {
            "seconds": ends[i] - ends[i - 1],
            "prompt_tokens": batches[i],
            "generated_tokens": reports[i].generated_tokens,
            "phases": reports[i].phase_seconds,
            "reward": reports[i].reward_mean,
        }
        for i in range(max(1, args.warmup), len(ends))
    ]
    return {"steps": per_step}


# ------------------------------------------------------------------------------------------------ TRL


def child_trl(size: Size, base: Path, args: argparse.Namespace) -> dict[str, Any]:
    import tempfile

    try:
        from datasets import Dataset
        from transformers import TrainerCallback
        from trl.trainer.grpo_config import GRPOConfig
        from trl.trainer.grpo_trainer import GRPOTrainer
    except ImportError as e:
        raise common.BaselineUnavailable(
            f"TRL is not installed ({e}); `make setup` installs trl==1.16.0"
        ) from e
    from rlhf_trainer.tasks.tiny import reward as tiny_reward

    rows = [json.loads(line) for line in (base / "prompts.jsonl").read_text().splitlines() if line.strip()]
    dataset = Dataset.from_list([{"prompt": r["prompt"]} for r in rows])

    def vowel_share(prompts: list[str], completions: list[str], **_: Any) -> list[float | None]:
        return [float(r) for r in tiny_reward(prompts, completions)]

    samples = size.prompts * size.samples
    ends: list[float] = []
    tokens: list[int] = []
    rewards: list[float] = []
    spent: dict[str, float] = {}
    profile: list[dict[str, float]] = []

    class StepTimes(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            ends.append(time.perf_counter())
            tokens.append(int(state.num_input_tokens_seen))
            profile.append(dict(spent))
            spent.clear()
            return control

        def on_log(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            logs = kwargs.get("logs")
            if logs and "reward" in logs:
                rewards.append(float(logs["reward"]))
            return control

    steps = args.warmup + (args.steps or size.steps)
    with tempfile.TemporaryDirectory(prefix="rlhf-bench-trl-") as out:
        config = GRPOConfig(
            output_dir=out,
            use_cpu=True,
            bf16=False,  # fp32 like ours: this CPU has no bf16 instructions (AVX2 only)
            gradient_checkpointing=False,  # TRL defaults to True: recompute only costs time at this size
            per_device_train_batch_size=size.micro_batch,
            gradient_accumulation_steps=samples // size.micro_batch,  # one update per generation
            num_generations=size.samples,
            max_completion_length=size.response_len,
            temperature=1.0,
            top_p=1.0,
            beta=0.0,
            num_iterations=1,
            learning_rate=5e-3,
            max_steps=steps,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            seed=0,
        )
        if args.trl_vllm:
            config.use_vllm, config.vllm_mode = True, "colocate"
        trainer = GRPOTrainer(
            model=str(base / "model"),
            reward_funcs=vowel_share,
            args=config,
            train_dataset=dataset,
            callbacks=[StepTimes()],
        )
        # Profile only: time TRL's own generation and its generate+score+advantages block per step.
        for method in ("_generate_single_turn", "_generate_and_score_completions"):
            setattr(trainer, method, timed(getattr(trainer, method), method, spent))
        trainer.train()
    per_step = [
        {
            "seconds": ends[i] - ends[i - 1],
            "tokens": tokens[i] - tokens[i - 1],
            "reward": rewards[i] if i < len(rewards) else float("nan"),
            "phases": {
                "generate": profile[i].get("_generate_single_turn", 0.0),
                "generate+score+advantages": profile[i].get("_generate_and_score_completions", 0.0),
            },
        }
        for i in range(max(1, args.warmup), len(ends))
    ]
    return {"steps": per_step}


def timed(fn: Any, name: str, spent: dict[str, float]) -> Any:
    """fn, adding its wall time to spent[name] (a profile of TRL's step; changes nothing it does)."""

    def wrapper(*a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0

    return wrapper


# ----------------------------------------------------------------------------------------------- main


def child(way: str, scale: int, args: argparse.Namespace) -> None:
    size = SIZES[scale]
    base = model_dir(scale)
    if way == "ours":
        os.environ.update(
            {
                "RAY_ADDRESS": "local",
                "RAY_TMPDIR": common.BENCH_RAY_TMP,
                "RLHF_WORKER_LOGS": "0",
                "RLHF_DEVICE": "cpu",
                "DS_ACCELERATOR": "cpu",
            }
        )
        out = child_ours(size, base, args)
        for s in out["steps"]:
            s["tokens"] = s["prompt_tokens"] + s["generated_tokens"]
    else:
        try:
            out = child_trl(size, base, args)
        except common.BaselineUnavailable as e:
            print(f"BASELINE-UNAVAILABLE {e}", file=sys.stderr, flush=True)
            sys.exit(3)
    print("CHILD " + json.dumps(out), flush=True)


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
    p.add_argument("--ours-ranks", type=int, default=2, help="our actor's ZeRO-3 ranks (processes)")
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
        model_dir(s)
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
                f"{args.ours_ranks} ZeRO-3 ranks + 1 vLLM engine, fp32"
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
                    common.median([x["reward"] for x in st]),
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
            for k, v in x["phases"].items():
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
