"""GRPO run plus weight-sync check, run as a subprocess by test_trainer_run.py (it needs its own driver).

Trains totalSteps GRPO steps through the real loop (so the actor's weights move far from the files the
engine loaded), then compares the vLLM engine's greedy tokens with an HF model built from the actor's
gathered ZeRO-3 weights. Prints one JSON line: per-step rewards and sync stats, and both generations.
Usage: weight_sync_check.py MANIFEST [path.to.field=value ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import ray
import torch
import yaml
from rlhf_trainer.cli import apply_overrides
from rlhf_trainer.driver import Trainer, connect_ray, parse_spec, preflight
from rlhf_trainer.loop import run_step
from rlhf_trainer.phases import TrainerMetrics

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


def main() -> int:
    manifest = apply_overrides(yaml.safe_load(Path(sys.argv[1]).read_text()), sys.argv[2:])
    spec = parse_spec(manifest)
    data = preflight(spec)
    trainer = Trainer(spec, "wscheck", data, TrainerMetrics("wscheck"), log=lambda m: None)
    started = connect_ray(trainer._process_count() + 1)
    try:
        trainer.place()
        trainer.setup()
        reports = [run_step(trainer, step) for step in range(1, spec.algorithm.total_steps + 1)]
        engine = trainer.pool.ready()[0].handle
        vllm_tokens = ray.get(engine.greedy.remote(PROMPTS, NEW_TOKENS))
        state = ray.get(trainer.actor_group.call("gathered_state_dict"))[0]
    finally:
        trainer.shutdown()
        if started:
            ray.shutdown()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(spec.model.actor)
    model = AutoModelForCausalLM.from_pretrained(spec.model.actor, dtype=torch.float32).eval()
    model.generation_config.pad_token_id = tok.pad_token_id
    base_tokens = hf_greedy(model, tok, PROMPTS)  # the weights on disk, before training
    result = model.load_state_dict(state, strict=True)
    hf_tokens = hf_greedy(model, tok, PROMPTS)
    print(
        json.dumps(
            {
                "rewards": [r.reward_mean for r in reports],
                "weight_sync_seconds": [r.phase_seconds.get("weight_sync", 0.0) for r in reports],
                "weight_sync_bytes": [r.weight_sync_bytes for r in reports],
                "step_seconds": [sum(r.phase_seconds.values()) for r in reports],
                "vllm": vllm_tokens,
                "hf": hf_tokens,
                "hf_base": base_tokens,
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
