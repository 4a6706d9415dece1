"""Weight-sync check, run as a subprocess by test_trainer_run.py (it needs its own Ray driver).

Trains one step (so the actor's weights differ from the files the engine loaded), syncs, then compares
the vLLM engine's greedy tokens with an HF model built from the actor's gathered ZeRO-3 weights.
Prints one JSON line.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import ray
import torch
import yaml

from rlhf_trainer.cli import apply_overrides
from rlhf_trainer.driver import Trainer, connect_ray, parse_spec, preflight
from rlhf_trainer.loop import run_step
from rlhf_trainer.phases import TrainerMetrics

PROMPTS = ["fer rust dil", "ba ko", "stou plaing tre", "zu", "kreast mol vi", "a"]
NEW_TOKENS = 24


def hf_greedy(model: torch.nn.Module, tokenizer: object, prompts: list[str]) -> list[list[int]]:
    out = []
    for p in prompts:
        ids = torch.tensor([tokenizer(p)["input_ids"]])  # type: ignore[operator]
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)  # type: ignore[operator]
        out.append(gen[0, ids.shape[1]:].tolist())
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
        report = run_step(trainer, 1)
        engine = trainer.pool.ready()[0].handle
        vllm_tokens = ray.get(engine.greedy.remote(PROMPTS, NEW_TOKENS))
        state = ray.get(trainer.actor_group.call("gathered_state_dict"))[0]
    finally:
        trainer.shutdown()
        if started:
            ray.shutdown()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(spec.model.actor)
    synced = AutoModelForCausalLM.from_pretrained(spec.model.actor, dtype=torch.float32).eval()
    base_tokens = hf_greedy(synced, tok, PROMPTS)  # the weights on disk, before training
    missing, unexpected = synced.load_state_dict(state, strict=True)
    hf_tokens = hf_greedy(synced, tok, PROMPTS)
    print(json.dumps({
        "vllm": vllm_tokens, "hf": hf_tokens, "hf_base": base_tokens, "tensors": len(state),
        "weight_sync_seconds": report.phase_seconds.get("weight_sync"), "bytes": report.weight_sync_bytes,
        "missing": list(missing), "unexpected": list(unexpected),
    }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
