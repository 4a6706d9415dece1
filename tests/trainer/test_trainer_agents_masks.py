"""Tool tokens train nothing (issue 37 item 4): a rollout with a loss mask (rollout.agent's trajectories,
packed by agents.samples) through the trainer's real code.

- The actor's and the critic's training (`PolicyModel.train`, `ValueModel.train` on real DeepSpeed ZeRO-3
  engines in a spawned rank, padded and packed micro-batches, every aggregation): whatever the tool
  positions hold (advantages, old, reference and engine log-probs, returns, old values) the gradient is
  bit-for-bit the same, so a tool token gets exactly zero gradient; the loss is normalised by the model
  tokens alone; and without the mask the gradient does change (the wiring is real).
- The advantages (`experience.compute`): every estimator on a trajectory with tool tokens gives, at its
  model tokens, what it gives on the same trajectory with the tool tokens cut out, and 0 at the tool
  tokens; the KL statistic counts model tokens only.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from rlhf_api.spec import RLHFJobSpec
from rlhf_trainer import experience
from rlhf_trainer.agents.contract import Trajectory
from rlhf_trainer.agents.samples import pack_trajectories
from rlhf_trainer.config import algorithm_settings
from rlhf_trainer.step_settings import RolloutCorrection
from rlhf_trainer.transfer import PackedRollout
from testkit.support import free_port, run_ranks, tiny_critic

pytestmark = pytest.mark.unit

# four episodes: model turn, tool output, model turn (and a single-turn one); mask 1 model / 0 tool
MASKS = [
    [1, 1, 1, 0, 0, 0, 0, 1, 1],
    [1, 1, 0, 0, 1, 1, 1, 0, 1],
    [1, 1, 1, 1],
    [1, 0, 0, 1, 1, 1, 1, 1],
]
PROMPTS = [5, 7, 4, 6]
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def _trajectories(vocab: int = 500) -> list[Trajectory]:
    g = torch.Generator().manual_seed(3)
    out = []
    for p, mask in zip(PROMPTS, MASKS, strict=True):
        prompt = torch.randint(3, vocab, (p,), generator=g).tolist()
        ids = torch.randint(3, vocab, (len(mask),), generator=g).tolist()
        lps = [-0.5 if m else 0.0 for m in mask]
        out.append(Trajectory(prompt, ids, list(mask), lps, turns=2))
    return out


def _rollout(with_mask: bool = True) -> PackedRollout:
    rollout = pack_trajectories(_trajectories(), [0, 0, 1, 1])
    if not with_mask:
        rollout.loss_mask = None
    return rollout


def _at_tools(values: torch.Tensor, fill: float) -> torch.Tensor:
    """`values` (packed over response tokens) with every tool position set to `fill`."""
    out = values.clone()
    out[_rollout().model_mask() == 0] = fill
    return out


# ---- training on real ZeRO-3 engines ---------------------------------------------------------------


def _settings(path: str, packing: bool) -> dict[str, Any]:
    """lr 0: the optimizer steps leave the weights as they are, so one engine computes every variant's
    gradient at the same weights."""
    return {
        "path": path, "rank": 0, "world_size": 1, "zero_stage": 3, "bf16": False, "offload": False,
        "gradient_checkpointing": False, "pad_id": 0, "lr_scheduler": "constant", "lr_warmup_steps": 0,
        "total_steps": 100, "train_micro_batch": 2, "temperature": 1.0, "lr": 0.0, "grad_accum": 2,
        "packing": packing,
    }  # fmt: skip


class FirstGradients:
    """Every parameter's full gradient at a training call's first accumulation boundary (engine.step
    wrapped); `take()` after each call."""

    def __init__(self, model: Any) -> None:
        from deepspeed.utils import safe_get_full_grad

        self.grads: dict[str, torch.Tensor] = {}
        engine = model.engine
        step = engine.step

        def recording_step() -> None:
            if not self.grads and engine.is_gradient_accumulation_boundary():
                for name, p in engine.module.named_parameters():
                    g = safe_get_full_grad(p)
                    if g is not None:
                        self.grads[name] = g.detach().clone().cpu()
            step()

        engine.step = recording_step

    def take(self) -> dict[str, torch.Tensor]:
        out, self.grads = self.grads, {}
        return out


VARIANTS = (("a", 0.3, True), ("b", -2.0, True), ("unmasked", -2.0, False))


def _train_ranks(rank: int, port: int, lm: str, critic: str, out: str) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1",
                       "LOCAL_RANK": "0", "DS_ACCELERATOR": "cpu"})  # fmt: skip
    torch.set_num_threads(1)
    from rlhf_trainer.workers.deepspeed_utils import init_distributed
    from rlhf_trainer.workers.policy import PolicyModel
    from rlhf_trainer.workers.value import ValueModel

    init_distributed("gloo")
    g = torch.Generator().manual_seed(11)
    n = int(_rollout().response_lens.sum())
    adv, noise, ret_noise = (torch.randn(n, generator=g) for _ in range(3))
    valid = torch.ones(4, dtype=torch.bool)
    res: dict[str, Any] = {}
    for packing in (False, True):
        actor = PolicyModel(lm, _settings(lm, packing))
        grads = FirstGradients(actor)
        old = actor.logprobs(_rollout(), 4)
        for mode in AGGREGATIONS:
            loss = _loss(kl_loss_coef=0.1, entropy_coef=0.01, aggregation=mode, norm_constant=16.0,
                         correction=RolloutCorrection(level="token", mode="truncate", lower=0.0, upper=2.0))  # fmt: skip
            for variant, fill, with_mask in VARIANTS:
                rollout = _rollout(with_mask)
                rollout.rollout_logprobs = _at_tools(old + 0.01 * noise, fill)
                stats = actor.train(
                    rollout, _at_tools(old + 0.02 * noise, fill), _at_tools(adv, fill),
                    _at_tools(old - 0.05 * noise.abs(), fill), valid, micro_batch=2, epochs=1, loss=loss,
                )  # fmt: skip
                res[f"actor/{packing}/{mode}/{variant}"] = grads.take()
                res[f"actor_stats/{packing}/{mode}/{variant}"] = stats
        # the plain surrogate on-policy (ratio 1): the loss is -mean(advantage) over model tokens
        stats = actor.train(_rollout(), None, _at_tools(adv, 5.0), None, valid, micro_batch=2, epochs=1,
                            loss=_loss(aggregation="token-mean"))  # fmt: skip
        res[f"plain/{packing}"] = stats["policy_loss"]
        model = ValueModel(critic, _settings(critic, packing))
        grads = FirstGradients(model)
        values = model.values(_rollout(), 4)
        for variant, fill, with_mask in VARIANTS:
            model.train(_rollout(with_mask), _at_tools(values + 0.1 * noise, fill),
                        _at_tools(values + ret_noise, fill), valid, micro_batch=2, epochs=1, clip=0.2)  # fmt: skip
            res[f"critic/{packing}/{variant}"] = grads.take()
    res["adv"] = adv
    torch.save(res, Path(out) / "masks.pt")


@pytest.fixture(scope="module")
def mask_steps(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("masks")
    critic = tiny_critic(tiny_model / "model", out)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run_ranks(_train_ranks, 1, (free_port(), str(tiny_model / "model"), str(critic), str(out)), timeout=600)
    result: dict[str, Any] = torch.load(out / "masks.pt")
    return result


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_tool_tokens_get_exactly_zero_gradient_in_the_policy_loss(
    mask_steps: dict[str, Any], packing: bool, mode: str
) -> None:
    """Clipped surrogate with the rollout correction, the KL loss and the entropy bonus: the tool positions'
    advantages and log-probs change nothing, bit for bit; without the mask they would."""
    a, b = mask_steps[f"actor/{packing}/{mode}/a"], mask_steps[f"actor/{packing}/{mode}/b"]
    assert len(a) > 10, "every weight must have a gradient"
    assert _same(a, b), "what the tool positions hold changed the actor's gradient"
    assert not _same(b, mask_steps[f"actor/{packing}/{mode}/unmasked"]), "the loss mask changed nothing"
    sa, sb = mask_steps[f"actor_stats/{packing}/{mode}/a"], mask_steps[f"actor_stats/{packing}/{mode}/b"]
    for key in (
        "policy_loss",
        "kl",
        "entropy",
        "rollout_logprob_gap",
        "logprob_gap_max",
        "behaviour_weight_mean",
    ):
        assert sa[key] == sb[key], key  # the statistics read model tokens only


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_the_policy_loss_is_normalised_by_the_model_tokens(mask_steps: dict[str, Any], packing: bool) -> None:
    adv, mask = mask_steps["adv"], _rollout().model_mask() > 0
    assert mask_steps[f"plain/{packing}"] == pytest.approx(-float(adv[mask].mean()), rel=1e-5)


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_tool_tokens_get_exactly_zero_gradient_in_the_value_loss(
    mask_steps: dict[str, Any], packing: bool
) -> None:
    a, b = mask_steps[f"critic/{packing}/a"], mask_steps[f"critic/{packing}/b"]
    assert len(a) > 10 and _same(a, b), "what the tool positions hold changed the critic's gradient"
    assert not _same(b, mask_steps[f"critic/{packing}/unmasked"])


# ---- advantages ---------------------------------------------------------------------------------------


_SPEC = RLHFJobSpec.model_validate(
    {
        "model": {"actor": "/m", "reward": {"type": "function", "function": "r:f"}},
        "data": {"prompts": "/p.jsonl"},
        "algorithm": {"rolloutBatchSize": 4, "samplesPerPrompt": 2},
    }
)


def _loss(**settings: Any) -> Any:
    """A policy loss: the plain PPO surrogate (k3, clip 0.2, no entropy or KL term), then `settings`."""
    from rlhf_trainer.workers.policy import PolicyLoss

    base: dict[str, Any] = {"policy_loss": "ppo", "clip_low": 0.2, "clip_high": 0.2, "dual_clip": None,
                            "entropy_coef": 0.0, "kl_loss_coef": 0.0, "kl_estimator": "k3",
                            "aggregation": "token-mean", "norm_constant": 1.0, "correction": None}  # fmt: skip
    return PolicyLoss(**{**base, **settings})


def _shard(rollout: PackedRollout, per_token: dict[str, torch.Tensor]) -> experience.ShardInputs:
    return experience.ShardInputs(
        scores=torch.tensor([0.9, -0.3, 0.5, 0.1]),
        valid=torch.tensor([True, True, True, True]),
        response_lens=rollout.response_lens,
        group=rollout.group,
        loss_mask=rollout.loss_mask,
        **per_token,
    )


def _cut(rollout: PackedRollout) -> PackedRollout:
    """The same samples with their tool tokens removed (every response token then the model's)."""
    keep = rollout.model_mask() > 0
    samples = []
    for t, m in zip(_trajectories(), MASKS, strict=True):
        ids = [x for x, k in zip(t.token_ids, m, strict=True) if k]
        samples.append((t.prompt_ids, ids, [-0.5] * len(ids)))
    cut = PackedRollout.from_samples(samples, rollout.group.tolist())
    assert int(cut.response_lens.sum()) == int(keep.sum())
    return cut


@pytest.mark.parametrize("estimator", ["gae", "grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"])
def test_advantages_skip_tool_tokens_as_if_they_were_not_there(estimator: str) -> None:
    rollout = _rollout()
    mask = rollout.model_mask() > 0
    g = torch.Generator().manual_seed(5)
    n = int(rollout.response_lens.sum())
    old, ref, values = (-torch.rand(n, generator=g) for _ in range(3))
    algo = replace(
        algorithm_settings(_SPEC), estimator=estimator, kl_coef=0.05, kl_in_loss=False, gamma=0.99, lam=0.95,
        kl_reward_estimator="k1",
    )  # fmt: skip
    full = {"old_logprobs": old, "ref_logprobs": ref, "values": values}
    tools = {k: _at_tools(v, 7.0) for k, v in full.items()}  # tool positions hold anything
    got, stats = experience.compute({0: _shard(rollout, tools)}, algo)
    cut = _cut(rollout)
    want, want_stats = experience.compute({0: _shard(cut, {k: v[mask] for k, v in full.items()})}, algo)
    adv = got[0].advantages
    torch.testing.assert_close(adv[mask], want[0].advantages, rtol=1e-6, atol=1e-6)
    assert torch.equal(adv[~mask], torch.zeros(int((~mask).sum())))
    if estimator == "gae":
        assert got[0].returns is not None and want[0].returns is not None
        torch.testing.assert_close(got[0].returns[mask], want[0].returns, rtol=1e-6, atol=1e-6)
        assert stats.explained_variance == pytest.approx(want_stats.explained_variance, abs=1e-9)
    assert stats.kl_tokens == int(mask.sum()) and stats.kl_sum == pytest.approx(want_stats.kl_sum, rel=1e-6)


def test_model_lens_and_packing_keep_the_mask() -> None:
    rollout = _rollout()
    assert rollout.model_lens.tolist() == [sum(m) for m in MASKS]
    picked = rollout.select([3, 0])
    assert picked.loss_mask is not None and picked.model_lens.tolist() == [sum(MASKS[3]), sum(MASKS[0])]
    both = PackedRollout.concat([picked, _rollout(with_mask=False).select([2])])
    assert both.model_lens.tolist() == [sum(MASKS[3]), sum(MASKS[0]), len(MASKS[2])]
    assert _rollout().digest() != _rollout(with_mask=False).digest()
