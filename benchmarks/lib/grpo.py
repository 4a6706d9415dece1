"""The GRPO runs the end-to-end benchmarks share: the model sizes, our trainer (`driver.run`) on a manifest,
TRL's GRPOTrainer as a CPU user runs it, and how each side's tokens and step times are counted.

Each runner is called in a fresh child process (`common.run_child`) and returns plain per-step dicts; the
scripts decide what to compare. Nothing here changes how either trainer works.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from . import common

EXAMPLE = common.ROOT / "examples" / "rlhfjob-tiny.yaml"
REWARD = "rlhf_trainer.tasks.tiny:reward"
MEDIUM_DIR = Path(os.environ.get("RLHF_BENCH_MEDIUM", "/tmp/rlhf-bench-e2e-medium"))
# The tiny example with the critic-free estimator (GRPO) instead of PPO's gae.
GRPO_SETS = ("algorithm.advantageEstimator=grpo", "model.critic=null", "trainer.critic=null")


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


def tiny_manifest(base: Path, sets: Sequence[str] = ()) -> dict[str, Any]:
    """examples/rlhfjob-tiny.yaml on the model in `base`, as GRPO, no checkpoints, then `sets`."""
    from rlhf_trainer.cli import apply_overrides

    manifest = yaml.safe_load(EXAMPLE.read_text())
    own = [
        f"model.actor={base}/model",
        f"data.prompts={base}/prompts.jsonl",
        *GRPO_SETS,
        "checkpoint.path=null",
    ]
    return dict(apply_overrides(manifest, [*own, *sets]))


def ours_manifest(base: Path, size: Size, steps: int, ranks: int, sets: Sequence[str] = ()) -> dict[str, Any]:
    """The tiny example as GRPO, no KL, one epoch, no checkpoints, this size (what TRL is also given)."""
    return tiny_manifest(
        base,
        [
            f"model.reward.function={REWARD}",
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
            *sets,
        ],
    )


def use_private_ray() -> None:
    """Our trainer in this process starts its own Ray (never a running one), on CPU, workers quiet."""
    os.environ.update(
        {
            "RAY_ADDRESS": "local",
            "RAY_TMPDIR": common.BENCH_RAY_TMP,
            "RLHF_WORKER_LOGS": "0",
            "RLHF_GPU_STANDIN": "cpu",  # no GPU here: logical GPUs placed, CPU kernels (the named stand-in)
            "DS_ACCELERATOR": "cpu",
        }
    )


def run_ours(
    manifest: dict[str, Any], steps: int, on_step: Callable[[Any], None] | None = None
) -> list[dict[str, Any]]:
    """`driver.run` on the manifest for `steps` steps. Per step: the driver's step summary, plus `end` (the
    perf_counter when the step ended) and `prompt_tokens` (its prompts' tokens x samples per prompt)."""
    from rlhf_trainer.config import parse_spec, preflight
    from rlhf_trainer.data import PromptBatch, PromptDataset
    from rlhf_trainer.driver import run, step_summary
    from transformers import AutoTokenizer

    spec = parse_spec(manifest)
    preflight(spec)
    tok = AutoTokenizer.from_pretrained(spec.model.actor)
    samples = spec.algorithm.samples_per_prompt
    drawn: list[int] = []

    class RecordingDataset(PromptDataset):
        """The driver's dataset, also counting each batch's prompt tokens (x samples per prompt), in the
        order drawn: step by step (asynchronous RL draws step n+1's batch during step n, still in order)."""

        def next_batch(self, n: int) -> PromptBatch:
            batch = super().next_batch(n)
            drawn.append(prompt_tokens(tok, [str(p) for p in batch.prompts]) * samples)
            return batch

    d = spec.data
    data = RecordingDataset(d.prompts, d.input_key, d.label_key, spec.algorithm.seed)
    records: list[dict[str, Any]] = []

    def record(report: Any) -> None:
        end = time.perf_counter()
        records.append({"end": end, "prompt_tokens": drawn[len(records)], **step_summary(report)})
        if on_step is not None:
            on_step(report)

    run(spec, "bench", steps=steps, metrics_port=0, on_step=record, log=lambda m: None, data=data)
    return records


def counted(records: list[dict[str, Any]], warmup: int) -> list[dict[str, Any]]:
    """Our steps after `warmup` (at least the first, whose start is unknown), each with `seconds` (end to
    end of the step before) and `tokens` (prompt + generated)."""
    return [
        {
            **records[i],
            "seconds": records[i]["end"] - records[i - 1]["end"],
            "tokens": records[i]["prompt_tokens"] + records[i]["generated_tokens"],
        }
        for i in range(max(1, warmup), len(records))
    ]


# ------------------------------------------------------------------------------------------------ TRL


def run_trl(size: Size, base: Path, steps: int, warmup: int, use_vllm: bool = False) -> list[dict[str, Any]]:
    """TRL's GRPOTrainer, one process, torch's default threads, the same model, reward, batch, response
    length, temperature and single update per step as `ours_manifest`. Per counted step: `seconds`,
    `tokens` (TRL's num_input_tokens_seen: prompt + completion), `reward_mean` and `phase_seconds` (a profile
    of its generation), the keys our steps have too."""
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
        if use_vllm:
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
    return [
        {
            "seconds": ends[i] - ends[i - 1],
            "tokens": tokens[i] - tokens[i - 1],
            "reward_mean": rewards[i] if i < len(rewards) else float("nan"),
            "phase_seconds": {
                "generate": profile[i].get("_generate_single_turn", 0.0),
                "generate+score+advantages": profile[i].get("_generate_and_score_completions", 0.0),
            },
        }
        for i in range(max(1, warmup), len(ends))
    ]


def timed(fn: Any, name: str, spent: dict[str, float]) -> Any:
    """fn, adding its wall time to spent[name] (a profile of TRL's step; changes nothing it does)."""

    def wrapper(*a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0

    return wrapper
