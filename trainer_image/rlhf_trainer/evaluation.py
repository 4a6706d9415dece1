"""The evaluation split (data.eval, spec.evaluation): generated on the rollout engines with its own sampling
settings, scored by the job's reward, and tallied overall and per `data_source`.

Owns the eval phase's work and its figures (`EvalTally`). Must not touch training state: its samples are
never trained on, never counted in a step's samples, tokens, reward errors or staleness, and it draws
nothing from the prompt dataset (its position and order are the training data's alone). When an evaluation
is due is `EvaluationSpec.due` (the spec).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray

from rlhf_trainer.data import Columns, EvalPrompts
from rlhf_trainer.rollout.dispatch import ChunkDispatcher
from rlhf_trainer.rollout.pool import EnginePool, EngineSlot
from rlhf_trainer.transfer import plan_chunks

# Evaluation prompts sent to the engines at a time: the driver holds one batch's rows, never the split.
EVAL_BATCH_PROMPTS = 256
SOURCE_COLUMN = "data_source"  # verl's column naming a row's dataset: eval_reward_mean is split by it


def source_of(columns: Columns) -> str | None:
    """A row's data_source as a label value, or None when the row has none."""
    value = columns.get(SOURCE_COLUMN)
    return None if value is None else str(value)


@dataclass
class EvalTally:
    """An evaluation's running sums: every sample scored, overall and per data_source. A sample whose
    reward failed counts in `errors` only, never in a mean."""

    prompts: int = 0
    samples: int = 0
    errors: int = 0
    score_sum: float = 0.0
    sources: dict[str, tuple[float, int]] = field(default_factory=dict)  # source -> (score sum, valid)

    def add(self, scores: Sequence[float | None], sources: Sequence[str | None]) -> None:
        """Samples' scores (None: the reward failed) with their rows' data_source."""
        for score, source in zip(scores, sources, strict=True):
            self.samples += 1
            if score is None:
                self.errors += 1
                continue
            self.score_sum += score
            if source is not None:
                total, count = self.sources.get(source, (0.0, 0))
                self.sources[source] = (total + score, count + 1)

    @property
    def valid(self) -> int:
        return self.samples - self.errors

    @property
    def reward_mean(self) -> float:
        return self.score_sum / max(self.valid, 1)

    def by_source(self) -> dict[str, float]:
        """Mean reward per data_source (empty when no row has the column)."""
        return {s: total / max(count, 1) for s, (total, count) in sorted(self.sources.items())}

    def report(self, step: int, weights_behind: int = 0) -> dict[str, Any]:
        """The step report's `eval` entry. `weights_behind`: optimizer steps the engines' weights lag the
        trained policy (asynchronous runs evaluate with the weights that generate the next batch)."""
        out: dict[str, Any] = {
            "step": step,
            "reward_mean": self.reward_mean,
            "prompts": self.prompts,
            "samples": self.samples,
            "valid_samples": self.valid,
            "reward_errors": self.errors,
            "weights_behind": weights_behind,
        }
        if self.sources:
            out["by_data_source"] = self.by_source()
        return out


def chunk_scores(result: Any) -> list[float | None]:
    """A chunk's RewardResult as one score per sample, None where the reward failed."""
    return [
        float(s) if v else None for s, v in zip(result.scores.tolist(), result.valid.tolist(), strict=True)
    ]


def evaluate(
    split: EvalPrompts,
    pool: EnginePool,
    reward: Any,
    sampling: dict[str, Any],
    step: int,
    on_lost: Callable[[EngineSlot, BaseException], None],
    batch_prompts: int = EVAL_BATCH_PROMPTS,
    dispatcher: Callable[[list[EngineSlot]], ChunkDispatcher] | None = None,
) -> EvalTally:
    """Generate and score the whole split on the pool's ready engines, `batch_prompts` at a time, through
    the training rollout's dispatcher (streamed, scored as each request finishes, a lost engine's chunks
    generated again); only the scores come back to the driver, and the packed tokens are dropped.
    `dispatcher(engines)`: the training rollout's own (rollout.agent: the agent's episodes); None: the
    engines' chunks."""
    tally = EvalTally()
    n = int(sampling["n"])
    for batch in split.batches(batch_prompts):
        engines = pool.ready()
        # one shard: no trainer rank reads these chunks; two chunks per engine, so scoring overlaps
        chunks = plan_chunks(len(batch.prompts), 1, len(engines), 2 * len(engines))
        chunked = (
            dispatcher(engines)
            if dispatcher is not None
            else ChunkDispatcher(step, engines, reward, sampling, on_lost)
        )
        chunked.run(chunks, batch.prompts, batch.labels, batch.columns)
        rollout, _ = chunked.scored()
        results = ray.get([result for _, result in rollout.reward_calls])
        for (_, _, idx), result in zip(chunks, results, strict=True):
            sources = [source_of(batch.columns[i]) for i in idx for _ in range(n)]
            tally.add(chunk_scores(result), sources)
        tally.prompts += len(batch.prompts)
    return tally
