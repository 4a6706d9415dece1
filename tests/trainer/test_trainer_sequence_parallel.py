"""Ulysses sequence parallelism (`rlhf_trainer.sequence_parallel`) between 2 real gloo processes.

With sequenceParallelSize 2 each process embeds half of every sequence; the per-token log-probs,
values, PPO loss and the gradients (after the data-parallel average DeepSpeed applies) must equal the
single-process forward on the whole batch. Samples are packed with different lengths, so the padded
micro-batch has right padding and an odd length that gets padded to a multiple of 2.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from testkit.support import free_port, run_ranks

pytestmark = pytest.mark.unit
WORLD = 2
PAD = 0

# float32 tolerances. The SP forward computes the same math on different tensor shapes: attention runs
# per head group over the whole sequence and matmuls run over half the rows, so only summation order
# differs. float32 has a 6e-8 unit roundoff; a 2-layer model and a 512-way log-softmax accumulate a few
# hundred such roundings, i.e. ~1e-6 relative. We allow 1e-5 relative (10x headroom) plus an absolute
# floor for values near 0; a wrong mask, position or head mapping shifts results by >= 1e-2.
RTOL, ATOL = 1e-5, 1e-5


def _rollout() -> Any:
    from rlhf_trainer.transfer import PackedRollout

    g = torch.Generator().manual_seed(3)
    lens = [(6, 31), (9, 17), (4, 40), (7, 8)]  # (prompt, response): longest 44 tokens, others padded
    samples = []
    for p, r in lens:
        ids = torch.randint(3, 500, (p + r,), generator=g).tolist()
        samples.append((ids[:p], ids[p:], [0.0] * r))
    return PackedRollout.from_samples(samples, groups=[0, 0, 1, 1])


def _load(path: str, kind: str, sp: Any) -> Any:
    from rlhf_trainer import sequence_parallel
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    cls = AutoModelForCausalLM if kind == "lm" else AutoModelForTokenClassification
    model = cls.from_pretrained(path, dtype=torch.float32)
    sequence_parallel.enable(model, sp)
    return model


def _ppo_loss_and_grads(model: Any, rollout: Any, sp: Any, old: torch.Tensor, adv: torch.Tensor) -> Any:
    """The actor's loss for one micro-batch, scaled and masked exactly as PolicyModel.train does it (a
    rollout with a loss mask, rollout.agent's: its model tokens only)."""
    from rlhf_trainer import algorithms
    from rlhf_trainer.workers.deepspeed_utils import response_logprobs

    model.zero_grad()
    valid = torch.tensor([True, True, False, True])
    denom = float(rollout.model_lens[valid].sum())
    sp_size = sp.size if sp is not None else 1
    out = response_logprobs(model, rollout, 0, rollout.num_samples, PAD, 1.0, sp)
    mask = out.mask * valid.float().unsqueeze(1) * out.local(rollout.model_mask())
    loss_sum, _ = algorithms.policy_loss(out.values, out.local(old), out.local(adv), mask, 0.2)
    torch.autograd.backward(loss_sum / denom * sp_size)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss_sum.detach() / denom, grads


def _sp_rank(rank: int, port: int, lm_dir: str, critic_dir: str, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    from rlhf_trainer import sequence_parallel
    from rlhf_trainer.workers.deepspeed_utils import response_logprobs, token_values

    sp = sequence_parallel.init_groups(WORLD)
    res: dict[str, Any] = {}

    # all-to-all: [B, H, T/P, D] -> [B, H/P, T, D] is the expected block of every rank, and back is exact
    xs = [torch.randn(2, 4, 3, 5, generator=torch.Generator().manual_seed(r)) for r in range(WORLD)]
    heads = sequence_parallel.seq_to_heads(xs[rank], sp.group)
    expected = torch.cat([x[:, rank * 2 : rank * 2 + 2] for x in xs], dim=2)
    res["a2a_forward_exact"] = torch.equal(heads, expected)
    res["a2a_roundtrip_exact"] = torch.equal(sequence_parallel.heads_to_seq(heads, sp.group), xs[rank])

    rollout = _rollout()
    n = rollout.num_samples
    base, split = _load(lm_dir, "lm", None), _load(lm_dir, "lm", sp)
    with torch.no_grad():
        res["lp1"] = response_logprobs(base, rollout, 0, n, PAD).packed()
        res["lp2"] = response_logprobs(split, rollout, 0, n, PAD, 1.0, sp).packed()
        c1, c2 = _load(critic_dir, "value", None), _load(critic_dir, "value", sp)
        res["v1"] = token_values(c1, rollout, 0, n, PAD).packed()
        res["v2"] = token_values(c2, rollout, 0, n, PAD, sp).packed()

    g = torch.Generator().manual_seed(11)
    old = res["lp1"] + 0.05 * torch.randn(res["lp1"].shape, generator=g)
    adv = torch.randn(res["lp1"].shape, generator=g)
    res["loss1"], grads1 = _ppo_loss_and_grads(base, rollout, None, old, adv)
    loss2_local, grads2 = _ppo_loss_and_grads(split, rollout, sp, old, adv)
    dist.all_reduce(loss2_local)  # each rank's loss covers its columns: the sum is the micro-batch's loss
    res["loss2"] = loss2_local
    # What DeepSpeed does with gradients: average over all ranks of the (here data-parallel size 1) world.
    for g2 in grads2.values():
        dist.all_reduce(g2)
        g2 /= WORLD
    res["grad_rel_err"] = {
        name: float((grads2[name] - g1).abs().max() / g1.abs().max().clamp_min(1e-12))
        for name, g1 in grads1.items()
    }
    res["grad_names"] = (sorted(grads1), sorted(grads2))

    # rollout.agent's loss mask under SP: every third response token a tool's, whatever it holds
    masked = _rollout()
    tools = torch.arange(int(masked.response_lens.sum())) % 3 == 1
    masked.loss_mask = (~tools).float()
    res["mloss1"], mgrads1 = _ppo_loss_and_grads(base, masked, None, old, adv)
    elsewhere = adv.clone()
    elsewhere[tools] = 9.0
    mloss2, mgrads2 = _ppo_loss_and_grads(split, masked, sp, old, elsewhere)
    dist.all_reduce(mloss2)
    res["mloss2"] = mloss2
    for g2 in mgrads2.values():
        dist.all_reduce(g2)
        g2 /= WORLD
    res["mgrad_rel_err"] = max(
        float((mgrads2[name] - g1).abs().max() / g1.abs().max().clamp_min(1e-12))
        for name, g1 in mgrads1.items()
    )
    res["mloss_unmasked_differs"] = not torch.allclose(res["mloss1"], res["loss1"])
    torch.save(res, Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def critic_dir(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a value head (seeded), saved once so both ranks load identical weights."""
    from transformers import AutoModelForTokenClassification

    torch.manual_seed(5)
    out = tmp_path_factory.mktemp("critic")
    AutoModelForTokenClassification.from_pretrained(tiny_model / "model", num_labels=1).save_pretrained(out)
    return out


def test_sp2_matches_sp1_logprobs_values_loss_and_gradients(
    tiny_model: Path, critic_dir: Path, tmp_path: Path
) -> None:
    args = (free_port(), str(tiny_model / "model"), str(critic_dir), str(tmp_path))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run_ranks(_sp_rank, WORLD, args, timeout=120)
    for rank in range(WORLD):
        r = torch.load(tmp_path / f"rank{rank}.pt")
        assert r["a2a_forward_exact"], f"rank {rank}: all-to-all did not deliver each rank's head block"
        assert r["a2a_roundtrip_exact"], f"rank {rank}: all-to-all back did not restore the input"
        n_tokens = int(_rollout().response_lens.sum())
        assert r["lp1"].shape == (n_tokens,) and r["lp2"].shape == (n_tokens,)
        torch.testing.assert_close(r["lp2"], r["lp1"], rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(r["v2"], r["v1"], rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(r["loss2"], r["loss1"], rtol=RTOL, atol=ATOL)
        names1, names2 = r["grad_names"]
        assert names1 == names2 and len(names1) > 10, "both paths must produce gradients for every weight"
        worst = max(r["grad_rel_err"].items(), key=lambda kv: kv[1])
        # Gradients are relative to each tensor's largest entry: same roundoff argument, one more pass.
        assert worst[1] < 1e-4, f"rank {rank}: gradient of {worst[0]} differs by {worst[1]:.2e} (relative)"
        # with a loss mask (tool tokens): SP 2 gives SP 1's loss and gradient, whatever the tool tokens hold
        torch.testing.assert_close(r["mloss2"], r["mloss1"], rtol=RTOL, atol=ATOL)
        assert r["mgrad_rel_err"] < 1e-4 and r["mloss_unmasked_differs"], r["mgrad_rel_err"]


def _manifest(model: str, sp: int, actor_ranks: int) -> dict[str, Any]:
    return {
        "apiVersion": "rlhf.dev/v1alpha1",
        "kind": "RLHFJob",
        "metadata": {"name": "sp"},
        "spec": {
            "model": {"actor": model, "critic": model, "reward": {"type": "function", "function": "r:f"}},
            "algorithm": {"rolloutBatchSize": 8},
            "data": {"prompts": "/p.jsonl"},
            "trainer": {
                "actor": {"nodes": 1, "gpusPerNode": actor_ranks},
                "critic": {"nodes": 1, "gpusPerNode": 1},
                "sequenceParallelSize": sp,
            },
        },
    }


def test_heads_not_divisible_is_rejected_by_rlhf_validate_naming_the_field(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import yaml
    from rlhf_api.validate import validate_manifest
    from rlhf_cli.main import main as cli_main

    model = str(tiny_model / "model")  # 2 heads, 2 key-value heads
    assert validate_manifest(_manifest(model, 2, 2)) == []
    issues = validate_manifest(_manifest(model, 4, 4))
    # actor and reference (4 ranks each) are split; the 1-rank critic runs whole sequences: not reported
    assert [(i.path, i.message) for i in issues] == [
        (
            "spec.trainer.sequenceParallelSize",
            f"4 must divide the attention heads of spec.model.{role} ({model}: "
            "num_attention_heads=2, num_key_value_heads=2)",
        )
        for role in ("actor", "reference")
    ]
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(_manifest(model, 4, 4)))
    assert cli_main(["validate", str(path)]) == 1
    assert "spec.trainer.sequenceParallelSize: 4 must divide the attention heads" in capsys.readouterr().out


def test_a_model_with_indivisible_heads_refuses_ulysses(tiny_model: Path) -> None:
    from rlhf_trainer import sequence_parallel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model / "model")
    sp = sequence_parallel.SequenceParallel(size=4, rank=0, dp_rank=0, dp_size=1)
    with pytest.raises(ValueError, match=r"spec.trainer.sequenceParallelSize: 4 must divide"):
        sequence_parallel.enable(model, sp)


def test_an_sp_block_is_one_data_parallel_shard(tiny_model: Path, tmp_path: Path) -> None:
    """Shards (and so the chunks each rank pulls) follow the data-parallel groups, not the ranks: the 2
    ranks of a block read the same shard, and a group the SP size does not divide keeps whole sequences."""
    import yaml
    from rlhf_api.rules import violated
    from rlhf_api.spec import RLHFJobSpec
    from rlhf_api.validate import runtime_issues
    from rlhf_trainer.cli import apply_overrides
    from rlhf_trainer.config import data_parallel_size, preflight

    example = Path(__file__).resolve().parents[2] / "examples" / "rlhfjob-tiny.yaml"

    def spec(*sets: str) -> Any:
        paths = [f"model.actor={tiny_model}/model", f"model.critic={tiny_model}/model",
                 f"data.prompts={tiny_model}/prompts.jsonl"]  # fmt: skip
        manifest = apply_overrides(yaml.safe_load(example.read_text()), [*paths, *sets])
        return RLHFJobSpec.model_validate(manifest["spec"], by_alias=True, by_name=False)

    s = spec("trainer.actor.gpusPerNode=4", "trainer.sequenceParallelSize=2")
    assert data_parallel_size(s, 4) == 2  # actor: 2 blocks of 2 -> 2 shards
    assert data_parallel_size(s, 1) == 1  # the 1-rank critic runs whole sequences
    assert violated(s) == []
    preflight(s)
    # The geometry is admission's (rlhf_api.rules), so a job that cannot shard is never admitted.
    # 2 blocks of 2 actor ranks and a 3-prompt batch: not even.
    uneven = spec(
        "trainer.actor.gpusPerNode=4", "trainer.sequenceParallelSize=2", "algorithm.rolloutBatchSize=3"
    )
    assert "rollout-batch-splits-over-actor-shards" in [rule.name for rule in violated(uneven)]
    # SP 4 over 4 actor ranks (1 shard); a 2-rank critic cannot split by 4: 2 whole-sequence ranks, 2 shards.
    # (the actor needs 4 heads for SP 4: only its config.json is read before start)
    four_heads = tmp_path / "four-heads"
    four_heads.mkdir()
    (four_heads / "config.json").write_text('{"num_attention_heads": 4, "num_key_value_heads": 4}')
    split = spec("trainer.actor.gpusPerNode=4", "trainer.critic.gpusPerNode=2", "trainer.sequenceParallelSize=4",
                 f"model.actor={four_heads}")  # fmt: skip
    assert [rule.name for rule in violated(split)] == ["critic-takes-whole-actor-shards"]
    assert runtime_issues(split) == []  # the heads of the one split model divide by 4
