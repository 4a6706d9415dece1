"""Async RL's step order (loop.next_async_batch) with fakes for the engines, the ranks and the weight sync:
the batch generated ahead is trained, the engines get the actor's weights between batches, the next batch
is launched with the version they then hold, and a batch beyond maxStaleness is regenerated (same
prompts) or dropped (next prompts), counted, and never trained on. The real path runs in
tests/e2e/ray (test_agent_run.py: the asynchronous agentic run)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
from rlhf_api.spec import RLHFJobSpec
from rlhf_trainer import loop
from rlhf_trainer.data import Prompt, PromptBatch
from rlhf_trainer.metrics import PhaseTimer, TrainerExporter
from rlhf_trainer.pipeline import Background
from rlhf_trainer.rollout.dispatch import Rollout
from rlhf_trainer.transfer import ChunkMeta

pytestmark = pytest.mark.unit


def _spec(**async_: Any) -> RLHFJobSpec:
    return RLHFJobSpec.model_validate(
        {
            "model": {"actor": "/m", "reward": {"type": "function", "function": "r:f"}},
            "data": {"prompts": "/p.jsonl"},
            "algorithm": {
                "rolloutBatchSize": 4,
                "samplesPerPrompt": 2,
                "totalSteps": 10,
                "async": {"enabled": True, **async_},
            },
        }
    )


@dataclass
class _Data:
    """Prompts p0, p1, ... in order; the position counts the prompts drawn."""

    drawn: int = 0

    @property
    def position(self) -> SimpleNamespace:
        return SimpleNamespace(to_dict=lambda: {"epoch": 0, "offset": self.drawn})

    def next_batch(self, n: int) -> PromptBatch:
        out: list[Prompt] = [f"p{i}" for i in range(self.drawn, self.drawn + n)]
        self.drawn += n
        return PromptBatch(out, [None] * n)


@dataclass
class _Sync:
    synced: int = 0

    def refresh(self, timer: PhaseTimer) -> int:
        return 0  # no membership change

    def sync(self) -> int:
        self.synced += 1
        return 100


@dataclass
class _Dispatcher:
    prompts: list[str]

    def scored(self) -> tuple[Rollout, list[Any]]:
        meta = ChunkMeta(chunk=0, rank=0, engine=0, samples=2 * len(self.prompts), prompt_tokens=1,
                         response_tokens=1, seconds=0.0)  # fmt: skip
        return Rollout([None], [meta], [(None, None)]), []


@dataclass
class _Ctx:
    spec: RLHFJobSpec
    data: _Data = field(default_factory=_Data)
    sync: _Sync = field(default_factory=_Sync)
    metrics: TrainerExporter = field(default_factory=lambda: TrainerExporter("j"))
    job: str = "j"
    placed: Any = field(
        default_factory=lambda: SimpleNamespace(
            pool=SimpleNamespace(ready=lambda: [object()]), new_step=lambda: None
        )
    )
    last_step: int = 10
    actor_version: int = 0
    engine_version: int = 0
    ahead: loop.Pending | None = None
    generating: list[tuple[float, float]] = field(default_factory=list)


@pytest.fixture
def generated(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, list[str]]]:
    """Every generation started, as (step, prompts); the engines are stand-ins that finish at once."""
    seen: list[tuple[int, list[str]]] = []

    def generate(ctx: Any, step: int, chunks: Any, batch: PromptBatch, timer: Any = None) -> _Dispatcher:
        prompts = [str(p) for p in batch.prompts]
        seen.append((step, prompts))
        return _Dispatcher(prompts)

    monkeypatch.setattr(loop, "generate", generate)
    monkeypatch.setattr(loop, "shards_of", lambda spec: 1)
    return seen


def _ahead(ctx: _Ctx, step: int, version: int) -> loop.Pending:
    """A batch generated ahead by weights `version`, already finished."""
    batch = ctx.data.next_batch(4)
    gen = loop.Generated(step, [(0, 0, [0, 1, 2, 3])], _Dispatcher([str(p) for p in batch.prompts]).scored()[0],
                         [], version, {"epoch": 0, "offset": ctx.data.drawn}, batch, 1.0)  # fmt: skip
    done = threading.Event()
    done.set()
    return loop.Pending(step, Background(lambda: gen), done, [0.0, 1.0])


def test_the_first_step_generates_now_then_launches_the_next_batch_with_the_engines_weights(
    generated: list[tuple[int, list[str]]],
) -> None:
    ctx = _Ctx(_spec())
    gen, sent, stale, put_aside = loop.next_async_batch(ctx, 1, PhaseTimer())  # type: ignore[arg-type]
    assert (gen.step, gen.version, stale, put_aside, sent) == (1, 0, 0, 0, 0)
    assert ctx.ahead is not None and ctx.ahead.step == 2
    ctx.ahead.work.result(timeout=5)
    assert [s for s, _ in generated] == [1, 2]
    assert gen.position == {"epoch": 0, "offset": 4}  # the trained batch's, not the one drawn ahead


def test_a_batch_one_step_old_is_trained_after_the_engines_get_the_new_weights(
    generated: list[tuple[int, list[str]]],
) -> None:
    ctx = _Ctx(_spec(), actor_version=3, engine_version=2)
    ctx.ahead = _ahead(ctx, 4, version=2)
    gen, sent, stale, put_aside = loop.next_async_batch(ctx, 4, PhaseTimer())  # type: ignore[arg-type]
    assert (gen.step, stale, put_aside) == (4, 1, 0)
    assert (ctx.sync.synced, sent, ctx.engine_version) == (1, 100, 3)  # one sync, between batches
    assert ctx.ahead is not None and ctx.ahead.step == 5
    assert ctx.ahead.work.result(timeout=5).version == 3  # launched after the sync
    assert [s for s, _ in generated] == [5]  # nothing regenerated


@pytest.mark.parametrize(("policy", "label"), [("Regenerate", "regenerated"), ("Drop", "dropped")])
def test_a_batch_beyond_max_staleness_is_never_trained_and_is_counted(
    generated: list[tuple[int, list[str]]], policy: str, label: str
) -> None:
    ctx = _Ctx(_spec(maxStaleness=1, staleSamples=policy), actor_version=3, engine_version=3)
    ctx.ahead = _ahead(ctx, 4, version=1)  # generated by weights 2 optimizer steps old
    stale_prompts = ctx.ahead.work.result().prompts.prompts
    gen, _, stale, put_aside = loop.next_async_batch(ctx, 4, PhaseTimer())  # type: ignore[arg-type]
    assert gen.version == 3 and stale == 0 and put_aside == 8  # 4 prompts x 2 samples set aside
    again = generated[0]
    assert again[0] == 4
    if policy == "Regenerate":
        assert again[1] == stale_prompts  # the same prompts, with the current weights
    else:
        assert again[1] == ["p4", "p5", "p6", "p7"]  # the next prompts: the stale ones are skipped
    counted = ctx.metrics.stale_samples.labels("j", label)._value.get()
    assert counted == 8
    assert ctx.ahead is not None
    ctx.ahead.work.result(timeout=5)
