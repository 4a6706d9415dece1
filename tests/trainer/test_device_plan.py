"""rlhf_trainer.device_plan: whole GPUs per rank, shared only where the spec colocates, and the checks
that catch a map that breaks it (the fractional-GPU map Ray made of the old requests, issue 33)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from rlhf_api.spec import RLHFJobSpec
from rlhf_trainer.cli import apply_overrides
from rlhf_trainer.device import STANDIN_ENV, DeviceError, for_job
from rlhf_trainer.device_plan import Observed, expected_sharing, plan, problems

pytestmark = pytest.mark.unit

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
REWARD_MODEL = ["model.reward.type=model", "model.reward.model=/models/rm", "model.reward.function=null"]


def _spec(name: str = "rlhfjob-tiny.yaml", *sets: str) -> Any:
    manifest = apply_overrides(yaml.safe_load((EXAMPLES / name).read_text()), list(sets))
    return RLHFJobSpec.model_validate(manifest["spec"], by_alias=True, by_name=False)


def _one_gpu_each(device_plan: Any) -> list[Observed]:
    """The map a correct placement yields: each (pool, bundle) its own GPU, pools on their own pods."""
    out = []
    for p in device_plan.processes:
        out.append(Observed(p.name, f"pod-{p.pool}", tuple(p.bundles)))
    return out


def test_separate_roles_get_a_whole_gpu_each_in_pools_of_their_own() -> None:
    dp = plan(_spec())
    assert [(p.name, p.bundles, p.pod_role) for p in dp.pools] == [
        ("actor+reference", 2, "trainer"), ("critic", 1, "trainer"), ("engine-0", 1, "rollout"),
    ]  # fmt: skip
    assert {p.name: p.shares for p in dp.processes} == {
        "actor+reference/0": (1.0,), "actor+reference/1": (1.0,), "critic/0": (1.0,), "engine-0": (1.0,),
    }  # fmt: skip
    assert all(not others for others in expected_sharing(dp).values())


def test_a_colocated_reward_model_shares_critic_rank_0s_gpu_and_no_other() -> None:
    dp = plan(_spec("rlhfjob-tiny.yaml", *REWARD_MODEL, "trainer.colocateCriticReward=true"))
    reward = next(p for p in dp.processes if p.roles == ("reward",))
    assert (reward.pool, reward.bundles, reward.shares) == ("critic", (0,), (0.5,))
    assert expected_sharing(dp)["reward"] == {"critic/0"}
    alone = plan(_spec("rlhfjob-tiny.yaml", *REWARD_MODEL, "trainer.colocateCriticReward=false"))
    assert next(p for p in alone.processes if p.roles == ("reward",)).shares == (1.0,)
    assert "reward" in [p.name for p in alone.pools]


def test_colocate_all_puts_engine_i_on_the_gpus_of_actor_ranks_i_tp_and_only_there() -> None:
    dp = plan(
        _spec(
            "rlhfjob-tiny.yaml", "trainer.colocateAll=true", "trainer.critic=null", "rollout.engines=1",
            "rollout.tensorParallelSize=2", "algorithm.advantageEstimator=grpo", "model.critic=null",
        )
    )  # fmt: skip
    assert [p.name for p in dp.pools] == ["actor+reference"]
    engine = next(p for p in dp.processes if p.roles == ("engine",))
    assert (engine.pool, engine.bundles, engine.shares) == ("actor+reference", (0, 1), (0.5, 0.5))
    assert expected_sharing(dp)["actor+reference/1"] == {"engine-0"}


def test_the_8b_example_uses_every_gpu_of_its_pods_once_or_as_colocated() -> None:
    dp = plan(_spec("rlhfjob-llama-8b.yaml"))
    assert dp.gpus("trainer") == 24 and dp.gpus("rollout") == 8
    assert problems(dp, _one_gpu_each(dp)) == []


def test_the_fractional_map_of_the_old_requests_is_refused() -> None:
    """What Ray made of 0.5-GPU critic requests on one 8-GPU pod: ranks paired on GPUs 0-3, 5-7 idle."""
    dp = plan(_spec("rlhfjob-llama-8b.yaml"))
    good = _one_gpu_each(dp)
    old = [
        Observed(o.process, "trainer-0", (o.gpus[0] // 2,)) if o.process.startswith("critic/") else o
        for o in good
    ]
    found = problems(dp, old)
    assert any("critic/1: shares GPU 0 of trainer-0 with critic/0" in f for f in found), found
    assert any("holds 2 critic processes" in f for f in found), found
    idle = problems(dp, old, {"trainer-0": 8})
    assert any("idle, which the plan meant to use" in f for f in idle), idle


def test_a_missing_process_or_a_wrong_gpu_count_is_a_problem() -> None:
    dp = plan(_spec())
    good = _one_gpu_each(dp)
    assert any("planned but not placed" in f for f in problems(dp, good[1:]))
    two = [Observed(o.process, o.pod, (0, 1)) if o.process == "critic/0" else o for o in good]
    assert any("critic/0: planned 1 whole GPU(s)" in f for f in problems(dp, two))


def test_the_device_comes_from_the_job_and_the_stand_in_is_named() -> None:
    assert for_job({}).kind == "cuda" and for_job({}).dist_backend == "nccl"  # never the head's hardware
    standin = for_job({STANDIN_ENV: "cpu"})
    assert (standin.kind, standin.dist_backend) == ("cpu", "gloo")
    with pytest.raises(DeviceError, match=STANDIN_ENV):
        for_job({STANDIN_ENV: "tpu"})
