"""The reference policy: a frozen DeepSpeed ZeRO-3 engine (no optimizer) giving log-probs for the KL.

Owns nothing but inference in rollout micro-batches; it is never trained nor checkpointed.
"""

from __future__ import annotations

from typing import Any

import torch

from rlhf_trainer import sequence_parallel
from rlhf_trainer.sequence_parallel import SequenceParallel
from rlhf_trainer.transfer import PackedRollout
from rlhf_trainer.workers.deepspeed_utils import ds_config, load_hf_model, response_logprobs


class ReferenceModel:
    def __init__(self, path: str, settings: dict[str, Any], sp: SequenceParallel | None = None) -> None:
        import deepspeed

        self.sp = sp
        dtype = torch.bfloat16 if settings["bf16"] else torch.float32
        cfg = ds_config(
            zero_stage=settings["zero_stage"],
            micro_batch=settings["train_micro_batch"],
            grad_accum=1,
            world_size=settings["world_size"],
            bf16=settings["bf16"],
            offload=settings["offload"],
            train=False,
        )
        model, keepalive = load_hf_model(path, "causal_lm", cfg, dtype)
        sequence_parallel.enable(model, sp)
        model.requires_grad_(False)
        self.engine, *_ = deepspeed.initialize(model=model, config=cfg)
        del keepalive
        self.pad_id = int(settings["pad_id"])
        self.temperature = float(settings.get("temperature", 1.0))

    @torch.no_grad()
    def logprobs(self, rollout: PackedRollout, micro_batch: int) -> torch.Tensor:
        self.engine.eval()
        out = [
            response_logprobs(self.engine, rollout, s, e, self.pad_id, self.temperature, self.sp).packed()
            for s, e in rollout.micro_batches(micro_batch)
        ]
        return torch.cat(out) if out else torch.zeros(0)
