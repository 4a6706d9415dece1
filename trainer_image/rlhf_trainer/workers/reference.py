"""The reference policy: a frozen DeepSpeed ZeRO-3 engine (no optimizer) giving log-probs for the KL.

Owns nothing but inference in rollout micro-batches; it is never trained nor checkpointed.
"""

from __future__ import annotations

from typing import Any

from rlhf_trainer.sequence_parallel import SequenceParallel
from rlhf_trainer.workers.deepspeed_utils import ResponseScorer, build_engine, resolve_packing


class ReferenceModel(ResponseScorer):
    def __init__(self, path: str, settings: dict[str, Any], sp: SequenceParallel | None = None) -> None:
        self.sp = sp
        self.engine = build_engine(path, settings, sp, head="causal_lm", train=False).engine
        self.pad_id = int(settings["pad_id"])
        self.temperature = float(settings.get("temperature", 1.0))
        self.packing = resolve_packing(self.engine, settings, sp, "reference")
