"""Phases that run at once (rlhf_trainer.overlap) in the real `loop.train_on`, with fakes for Ray and the
groups: the experience forwards and the two trainings are all launched before anything is waited on
when different groups host them, a group's own phases keep their order, and RLHF_SEQUENTIAL_PHASES=1
(the overlap benchmark's baseline) runs one phase at a time. The real path runs in tests/e2e/ray."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import ray
from rlhf_api.spec import RLHFJobSpec
from rlhf_trainer import loop
from rlhf_trainer.metrics import PHASES, PhaseTimer, TrainerExporter
from rlhf_trainer.overlap import SEQUENTIAL_ENV, PhaseWork, run_phases
from rlhf_trainer.placement import Placed
from rlhf_trainer.rollout.dispatch import Rollout
from rlhf_trainer.transfer import ChunkMeta

pytestmark = pytest.mark.unit

EXPERIENCE = ("ref_logprobs", "critic_values", "old_logprobs")
TRAINING = ("train_actor", "train_critic")
ACTOR_STATS = dict.fromkeys(
    ("policy_loss", "clip_frac", "dual_clip_frac", "kl_loss", "entropy", "optimizer_steps",
     "rollout_logprob_gap", "first_ratio_deviation", "logprob_gap_mean", "logprob_gap_p99",
     "logprob_gap_max", "kl"),
    0.0,
) | {"trained_tokens": 8.0}  # fmt: skip
ADVANTAGE_STATS = {"valid": 2.0, "score_sum": 1.0, "kl_tokens": 4.0, "kl_sum": 0.4}


@dataclass(frozen=True, eq=False)
class _Ref:
    """A fake object ref: which group and method made it, and the value `ray.get` gives."""

    group: str
    method: str
    rank: int
    value: Any = None


@dataclass
class _Ray:
    """Stands in for ray.wait / ray.get and records, in order, every call launched (`launch`) and every
    wait or get (`wait`, `get`: the methods waited on and the phases in progress at that moment)."""

    metrics: TrainerExporter
    events: list[tuple[str, Any]] = field(default_factory=list)

    def in_progress(self) -> set[str]:
        gauge = self.metrics.phase_in_progress
        return {p for p in PHASES if gauge.labels(self.metrics.job, p)._value.get() == 1}

    def wait(self, refs: list[_Ref], num_returns: int = 1, **_: Any) -> tuple[list[_Ref], list[_Ref]]:
        self.events.append(("wait", (sorted({r.method for r in refs}), self.in_progress())))
        return list(refs[:num_returns]), list(refs[num_returns:])

    def get(self, refs: Any, **_: Any) -> Any:
        listed = refs if isinstance(refs, list) else [refs]
        self.events.append(("get", (sorted({r.method for r in listed}), self.in_progress())))
        return [r.value for r in refs] if isinstance(refs, list) else refs.value


@dataclass
class _Group:
    """A fake RayGroup of `world_size` ranks: every call is recorded as launched and returns fake refs."""

    name: str
    ray: _Ray
    world_size: int = 1

    def call(
        self, method: str, *args: Any, per_rank: Any = None, num_returns: int = 1, **_: Any
    ) -> list[Any]:
        self.ray.events.append(("launch", method))
        if num_returns == 2:  # advantages: (stats, returns) per rank
            return [(_Ref(self.name, method, r, ADVANTAGE_STATS), _Ref(self.name, method, r)) for r in range(self.world_size)]  # fmt: skip
        value = ACTOR_STATS if method == "train_actor" else {"value_loss": 0.1, "first_value_deviation": 0.0}
        return [_Ref(self.name, method, r, value) for r in range(self.world_size)]

    def get(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:  # RayGroup.get: call, then wait
        return list(ray.get(self.call(method, *args, **kwargs)))


def _spec() -> RLHFJobSpec:
    """PPO with a critic, a reference (klCoef > 0) and old log-probs (2 epochs): all three forwards."""
    return RLHFJobSpec.model_validate(
        {
            "model": {"actor": "/m", "critic": "/m", "reward": {"type": "function", "function": "r:f"}},
            "data": {"prompts": "/p.jsonl"},
            "algorithm": {"advantageEstimator": "gae", "klCoef": 0.01, "epochs": 2, "totalSteps": 3},
        }
    )


def _train_on(monkeypatch: pytest.MonkeyPatch, layout: str) -> _Ray:
    """Run loop.train_on once with the roles laid out as `layout`: "separate" (one group per role),
    "actor+ref" (the reference on the actor's group) or "one" (every role on one group). Returns the
    recorded launches and waits."""
    metrics = TrainerExporter("j")
    fake = _Ray(metrics)
    monkeypatch.setattr(ray, "wait", fake.wait)
    monkeypatch.setattr(ray, "get", fake.get)
    actor, critic, ref = _Group("actor", fake), _Group("critic", fake), _Group("reference", fake)
    roles = {
        "separate": {"actor": actor, "critic": critic, "reference": ref},
        "actor+ref": {"actor": actor, "critic": critic, "reference": actor},
        "one": {"actor": actor, "critic": actor, "reference": actor},
    }[layout]
    groups = tuple({id(g): g for g in roles.values()}.values())
    placed = Placed(groups, roles, {g.name: 1 for g in groups}, pool=None, reward=None)  # type: ignore[arg-type]
    sync = SimpleNamespace(engines_sleep=lambda asleep: None, sync=lambda: 0, take_stats=dict)
    checkpointer = SimpleNamespace(due=lambda step: False, algorithm_state={}, trained_position=None)
    ctx = loop.StepContext(_spec(), "j", None, placed, sync, checkpointer, metrics)  # type: ignore[arg-type]
    meta = ChunkMeta(chunk=0, rank=0, engine=0, samples=2, prompt_tokens=1, response_tokens=4, seconds=0.1)
    rollout = Rollout([_Ref("engine", "packed", 0)], [meta], [(None, _Ref("reward", "scores", 0))])
    gen = loop.Generated(1, [(0, 0, [0])], rollout, [], 0, {}, (["p"], [None]), 0.1)
    report = loop.train_on(ctx, 1, gen, PhaseTimer(metrics), 0, time.monotonic())
    assert report.training["policy_loss"] == 0.0 and report.training["value_loss"] == 0.1
    assert fake.in_progress() == set()  # every gauge back to 0
    return fake


def _launched_before_first_wait(fake: _Ray, methods: tuple[str, ...]) -> list[str]:
    """Of `methods`, those launched before the first wait (or blocking get) on any of them."""
    first = next(
        i
        for i, (kind, what) in enumerate(fake.events)
        if kind in ("wait", "get") and set(what[0]) & set(methods)
    )
    return [m for kind, m in fake.events[:first] if kind == "launch" and m in methods]


def test_forwards_and_trainings_on_separate_groups_are_all_launched_before_any_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(SEQUENTIAL_ENV, raising=False)
    fake = _train_on(monkeypatch, "separate")
    assert _launched_before_first_wait(fake, EXPERIENCE) == list(EXPERIENCE)
    assert _launched_before_first_wait(fake, TRAINING) == list(TRAINING)
    waits = [what for kind, what in fake.events if kind == "wait"]
    # the first wait of each block sees all of its phases in progress at once
    assert {"reference", "critic_values", "old_logprobs"} <= waits[0][1]
    first_training = next(w for w in waits if "train_actor" in w[0])
    assert {"actor_train", "critic_train"} <= first_training[1]


def test_phases_on_one_group_keep_their_order_and_run_one_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reference on the actor's group: the critic's forward overlaps both, but old log-probs are
    launched only once the reference's refs are done (the group's processes run one call at a time)."""
    monkeypatch.delenv(SEQUENTIAL_ENV, raising=False)
    fake = _train_on(monkeypatch, "actor+ref")
    assert _launched_before_first_wait(fake, EXPERIENCE) == ["ref_logprobs", "critic_values"]
    launches = [m for kind, m in fake.events if kind == "launch"]
    assert launches.index("ref_logprobs") < launches.index("old_logprobs")
    assert all(
        "old_logprobs" not in what[1] or "reference" not in what[1] for k, what in fake.events if k == "wait"
    )
    assert _launched_before_first_wait(fake, TRAINING) == list(TRAINING)  # the critic still has its own

    one = _train_on(monkeypatch, "one")  # colocateAll: nothing overlaps, the order is the old one
    assert [m for kind, m in one.events if kind == "launch" and m in EXPERIENCE + TRAINING] == list(
        EXPERIENCE + TRAINING
    )
    assert all(len(what[1]) == 1 for kind, what in one.events if kind == "wait")


def test_sequential_phases_env_runs_one_phase_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SEQUENTIAL_ENV, "1")
    fake = _train_on(monkeypatch, "separate")
    assert _launched_before_first_wait(fake, EXPERIENCE) == ["ref_logprobs"]
    assert _launched_before_first_wait(fake, TRAINING) == ["train_actor"]
    launches = [m for kind, m in fake.events if kind == "launch" and m in EXPERIENCE + TRAINING]
    assert launches == list(EXPERIENCE + TRAINING)
    assert all(len(what[1]) == 1 for kind, what in fake.events if kind == "wait")  # one phase at a time


def test_each_phase_is_timed_to_its_own_refs_and_an_error_surfaces_in_its_phase(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two lanes: `fast`'s one ref is done at the first wait, `slow`'s two at the third. Each phase's
    seconds run to its own end, so they sum to more than the wall time; a failing `get` is raised while
    its own phase is in progress, and nothing stays marked in progress after it."""
    monkeypatch.delenv(SEQUENTIAL_ENV, raising=False)
    m = TrainerExporter("j")
    fake = _Ray(m)

    def slow_wait(refs: list[_Ref], num_returns: int = 1, **_: Any) -> tuple[list[_Ref], list[_Ref]]:
        time.sleep(0.05)
        return fake.wait(refs, num_returns)

    monkeypatch.setattr(ray, "wait", slow_wait)
    monkeypatch.setattr(ray, "get", fake.get)
    timer = PhaseTimer(m)
    works = [
        PhaseWork("reference", "ref", lambda: [_Ref("ref", "ref_logprobs", 0)]),
        PhaseWork("critic_values", "critic", lambda: [_Ref("critic", "critic_values", r) for r in (0, 1)]),
    ]
    t0 = time.perf_counter()
    done = run_phases(timer, works)
    wall = time.perf_counter() - t0
    assert set(done) == {"reference", "critic_values"}
    assert 0.04 < timer.seconds["reference"] < timer.seconds["critic_values"] - 0.04
    assert timer.seconds["reference"] + timer.seconds["critic_values"] > wall
    in_progress = [what[1] for kind, what in fake.events if kind == "wait"]
    assert in_progress == [{"reference", "critic_values"}, {"critic_values"}, {"critic_values"}]

    failing: list[set[str]] = []

    def get(refs: Any, **_: Any) -> Any:
        if any(r.method == "critic_values" for r in refs):
            failing.append(fake.in_progress())
            raise RuntimeError("critic rank 0 died")
        return fake.get(refs)

    monkeypatch.setattr(ray, "get", get)
    with pytest.raises(RuntimeError, match="critic rank 0 died"):
        run_phases(PhaseTimer(m), works)
    assert failing == [{"critic_values"}]  # raised inside its phase (the reference's was done)
    assert fake.in_progress() == set()
