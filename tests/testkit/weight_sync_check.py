"""GRPO run plus weight-sync check, run as a subprocess by test_trainer_run.py (it needs its own driver).

Trains totalSteps GRPO steps through the real loop (so the actor's weights move far from the files the
engines loaded), growing the engine pool from one to two engines before the last two steps, then
compares every engine's greedy tokens with an HF model built from the actor's gathered ZeRO-3 weights.
Prints one JSON line: per-step rewards, phase timings and sync stats, and the generations.
Usage: weight_sync_check.py MANIFEST [path.to.field=value ...]
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import ray
import torch
import yaml
from prometheus_client import generate_latest
from rlhf_trainer import device_plan
from rlhf_trainer.checkpoint import Checkpointer
from rlhf_trainer.cli import apply_overrides
from rlhf_trainer.config import parse_spec, preflight
from rlhf_trainer.device import for_job
from rlhf_trainer.driver import connect_ray
from rlhf_trainer.export import export_actor
from rlhf_trainer.loop import StepContext, run_step
from rlhf_trainer.metrics import TrainerExporter
from rlhf_trainer.placement import Placed, place, process_count, start
from rlhf_trainer.rollout.engine import RolloutEngine
from rlhf_trainer.weight_sync.manager import WeightSyncManager

PROMPTS = ["fer rust dil", "ba ko", "stou plaing tre", "zu", "kreast mol vi", "a"]
NEW_TOKENS = 24


def hf_greedy(model: Any, tokenizer: Any, prompts: list[str]) -> list[list[int]]:
    out = []
    for p in prompts:
        ids = torch.tensor([tokenizer(p)["input_ids"]])
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        out.append(gen[0, ids.shape[1] :].tolist())
    return out


def log(message: str) -> None:
    del message  # quiet: the one JSON line is this script's output


def main() -> int:
    manifest = apply_overrides(yaml.safe_load(Path(sys.argv[1]).read_text()), sys.argv[2:])
    spec = parse_spec(manifest)
    data = preflight(spec)
    metrics, info = TrainerExporter("wscheck"), for_job(os.environ)  # the runner sets the CPU stand-in
    started = connect_ray(
        process_count(spec) + 1, device_plan.most_gpus(spec) + 1 if info.is_cpu else 0
    )  # +1: it grows the pool
    placed: Placed | None = None
    sync: WeightSyncManager | None = None
    try:
        placed = place(spec, info, log)
        start(placed, spec, metrics, log)
        sync = WeightSyncManager(
            spec, "wscheck", info, placed.actor, placed.pool, metrics, log, resumed=False
        )
        checkpointer = Checkpointer(spec, "wscheck", data, placed.groups, metrics, log)
        ctx = StepContext(spec, "wscheck", data, placed, sync, checkpointer, metrics)
        total = spec.algorithm.total_steps
        reports = [run_step(ctx, step) for step in range(1, total - 1)]
        # The cluster gains a rollout slot: at the next step boundary the pool starts an engine in the
        # background (step total-1 still generates on one engine); once it is ready, the last step's
        # boundary rebuilds the sync group, and from then on every bucket goes once to both engines.
        placed.pool.desired_from_cluster = lambda fallback, draining=(): fallback + 1  # type: ignore[method-assign]
        reports.append(run_step(ctx, total - 1))
        placed.pool.wait_ready()
        reports.append(run_step(ctx, total))
        engines = placed.pool.ready()
        engine_tokens = ray.get([e.handle.greedy.remote(PROMPTS, NEW_TOKENS) for e in engines])
        state = ray.get(placed.actor.call("gathered_state_dict"))[0]
        scrape = generate_latest(metrics.registry).decode()
        engine_options = dict(placed.pool.options)
    finally:
        if sync is not None:
            sync.close()
        if placed is not None:
            placed.shutdown()
        if started:
            ray.shutdown()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(spec.model.actor)
    model = AutoModelForCausalLM.from_pretrained(spec.model.actor, dtype=torch.float32).eval()
    model.generation_config.pad_token_id = tok.pad_token_id
    base_tokens = hf_greedy(model, tok, PROMPTS)  # the weights on disk, before training
    result = model.load_state_dict(state, strict=True)
    hf_tokens = hf_greedy(model, tok, PROMPTS)
    # The last checkpoint (step totalSteps) exported as `rlhf export` does, then loaded back in
    # transformers and in a vLLM engine of our own (this process; Ray is down).
    assert spec.checkpoint.path
    exported = export_actor(Path(spec.checkpoint.path), Path(spec.checkpoint.path) / "exported")
    export_model = AutoModelForCausalLM.from_pretrained(str(exported.path), dtype=torch.float32).eval()
    export_model.generation_config.pad_token_id = tok.pad_token_id
    export_hf = hf_greedy(export_model, AutoTokenizer.from_pretrained(str(exported.path)), PROMPTS)
    engine = RolloutEngine(99, {**engine_options, "model_path": str(exported.path), "tokenizer_path": None})
    export_vllm = engine.greedy(PROMPTS, NEW_TOKENS)
    print(
        json.dumps(
            {
                "rewards": [r.reward_mean for r in reports],
                "weight_sync_seconds": [r.phase_seconds.get("weight_sync", 0.0) for r in reports],
                "weight_sync_bytes": [r.weight_sync_bytes for r in reports],
                "step_seconds": [sum(r.phase_seconds.values()) for r in reports],
                "phase_seconds": [r.phase_seconds for r in reports],
                "generated_tokens": [r.generated_tokens for r in reports],
                "training": [r.training for r in reports],
                "dynamic_sampling": [r.dynamic_sampling for r in reports],
                "engines": [e.index for e in engines],
                "engines_used": [r.engines for r in reports],
                "engines_metric": scrape.count('rlhf_rollout_engines{rlhfjob="wscheck",state="ready"} 2.0'),
                "vllm": engine_tokens,
                "hf": hf_tokens,
                "hf_base": base_tokens,
                "export_step": exported.step,
                "export_hf": export_hf,
                "export_vllm": export_vllm,
                "tensors": len(state),
                "param_bytes": sum(t.numel() * t.element_size() for t in state.values()),
                "missing": list(result.missing_keys),
                "unexpected": list(result.unexpected_keys),
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
