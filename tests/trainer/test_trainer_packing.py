"""Packed micro-batches (issue 39, item 2, the layout): samples back to back in one row with position ids
restarted per sample give, on a real model (the tiny Llama, transformers' own attention), the same
response log-probs as the padded batch; without the restart, or with an attention mask that turns the
packed-sample detection off, they do not (nor with a KV cache: transformers detects packing only without
one, so every forward here passes use_cache=False, as the trainer's do). `trainer.packing` (the trainer's
forwards and training on packed micro-batches): the micro-batches are cut by tokens, keep their count, and
the loss, every parameter gradient and the training statistics equal the padded path's; the fallbacks
(sequence parallelism, a model that does not isolate packed samples) are said, not silent."""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from rlhf_trainer import algorithms
from rlhf_trainer.transfer import (
    PackedRollout,
    balance_by_tokens,
    pack_micro_batch,
    pad_micro_batch,
    unpad_response_values,
)
from testkit.support import free_port, run_ranks, tiny_critic

pytestmark = pytest.mark.unit


def _rollout(vocab: int) -> PackedRollout:
    g = torch.Generator().manual_seed(0)
    samples = []
    for p, r in ((5, 9), (3, 2), (12, 17), (1, 4), (7, 1)):  # ragged, and skewed
        prompt = torch.randint(3, vocab, (p,), generator=g).tolist()
        resp = torch.randint(3, vocab, (r,), generator=g).tolist()
        samples.append((prompt, resp, [0.0] * r))
    return PackedRollout.from_samples(samples, list(range(5)))


def _logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def _padded(model: Any, r: PackedRollout) -> torch.Tensor:
    ids, attn, act = pad_micro_batch(r, 0, r.num_samples, 0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits[:, :-1]
    return unpad_response_values(_logprobs(logits, ids[:, 1:]), act)


def test_packed_equals_padded_and_needs_the_position_restart(model: Any) -> None:
    r = _rollout(int(model.config.vocab_size))
    padded = _padded(model, r)
    ids, pos, labels, act = pack_micro_batch(r, 0, r.num_samples)
    assert ids.shape[1] == int(r.seq_lens.sum())  # no padding at all
    with torch.no_grad():
        packed_lp = unpad_response_values(
            _logprobs(model(input_ids=ids, position_ids=pos, use_cache=False).logits, labels), act
        )
        running = torch.arange(ids.shape[1]).unsqueeze(0)  # positions not restarted: one long sequence
        leaky = unpad_response_values(
            _logprobs(model(input_ids=ids, position_ids=running, use_cache=False).logits, labels), act
        )
        masked = model(
            input_ids=ids, position_ids=pos, attention_mask=torch.ones_like(ids), use_cache=False
        ).logits
    assert packed_lp.numel() == padded.numel() == int(r.response_lens.sum())
    assert torch.allclose(packed_lp, padded, atol=1e-5), (packed_lp - padded).abs().max()
    assert (leaky - padded).abs().max() > 1e-3  # attention crossed sample boundaries
    crossed = unpad_response_values(_logprobs(masked, labels), act)
    assert (crossed - padded).abs().max() > 1e-3  # a mask given: transformers no longer isolates samples
    # a sub-range of samples packs the same way
    ids2, pos2, labels2, act2 = pack_micro_batch(r, 2, 4)
    assert ids2.shape[1] == int(r.seq_lens[2:4].sum()) and pos2[0, 0] == 0
    assert labels2[0, 0] == ids2[0, 1]  # the next token of the same sample
    assert int(act2.sum()) == int(r.response_lens[2:4].sum())


def test_the_packer_restarts_position_ids_for_every_sample() -> None:
    r = _rollout(100)
    _, pos, _, _ = pack_micro_batch(r, 0, r.num_samples)
    expected = torch.cat([torch.arange(int(n)) for n in r.seq_lens])
    assert torch.equal(pos[0], expected)


def test_micro_batches_are_cut_by_tokens_and_keep_their_count() -> None:
    lens = [300, 4, 6, 5, 7, 250, 3, 8, 9, 6, 5, 4]  # skewed: two long samples
    r = PackedRollout.from_samples([([1] * n, [2], [0.0]) for n in lens], list(range(len(lens))))
    padded = r.mini_batches(2, 3)
    packed = r.mini_batches(2, 3, by_tokens=True)
    assert [len(mb) for mb in packed] == [len(mb) for mb in padded]  # DeepSpeed's accumulation boundaries
    assert [(mb[0][0], mb[-1][1]) for mb in packed] == [(mb[0][0], mb[-1][1]) for mb in padded]
    seq = r.seq_lens
    for mb in packed:
        assert all(e > s for s, e in mb) and all(a[1] == b[0] for a, b in itertools.pairwise(mb))
        budget = float(seq[mb[0][0] : mb[-1][1]].sum()) / len(mb)
        assert max(int(seq[s:e].sum()) for s, e in mb) <= budget + int(seq[mb[0][0] : mb[-1][1]].max())
    # the long sample gets a micro-batch of its own; the padded cut puts it beside two short ones
    assert packed[0][0] == (0, 1) and padded[0][0] == (0, 3)
    assert list(r.micro_batches(5, by_tokens=True)) == balance_by_tokens(seq, 0, len(lens), 3)
    assert balance_by_tokens(seq, 0, 2, 5) == [(0, 1), (1, 2)]  # never an empty micro-batch


def _loss(out: Any, r: PackedRollout, s: int, e: int, adv: torch.Tensor, mode: str) -> torch.Tensor:
    """The policy loss as PolicyModel.train builds it: PPO clip, the aggregation, KL and entropy."""
    lp, mask = out.values, out.mask
    old = out.local(adv * 0.05).detach() + lp.detach()
    tl = algorithms.ppo_tokens(lp, old - 0.02, out.local(adv), 0.2, 0.2, 3.0)
    seq = r.response_lens[s:e]
    loss = algorithms.aggregate_loss(tl.loss, mask, mode, None, seq, norm_constant=32.0)
    loss = loss - 0.01 * algorithms.aggregate_loss(out.entropy, mask, mode, None, seq, 32.0)
    kl = algorithms.kl_per_token(lp, old + 0.1, "k3")
    return loss + 0.05 * algorithms.aggregate_loss(kl, mask, mode, None, seq, 32.0)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_packed_training_forward_gives_the_padded_loss_and_gradients(model: Any, mode: str) -> None:
    """The trainer's own forward (response_logprobs) both ways over a micro-batch of skewed lengths."""
    from rlhf_trainer.workers.deepspeed_utils import response_logprobs

    r = _rollout(int(model.config.vocab_size))
    adv = torch.randn(int(r.response_lens.sum()), generator=torch.Generator().manual_seed(1))
    results = []
    for packed in (False, True):
        model.zero_grad()
        out = response_logprobs(model, r, 0, r.num_samples, 0, 0.9, None, 1.0, True, packed=packed)
        loss = _loss(out, r, 0, r.num_samples, adv, mode)
        loss.backward()  # type: ignore[no-untyped-call]
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((float(loss.detach()), grads, out.packed(), out.values.shape))
    (l0, g0, lp0, shape0), (l1, g1, lp1, shape1) = results
    assert shape0 == shape1  # the packed results come back in the padded layout
    assert abs(l0 - l1) <= 1e-5, (l0, l1)
    assert torch.allclose(lp0, lp1, atol=1e-5)
    assert sorted(g0) == sorted(g1) and len(g0) > 10
    for name, g in g0.items():
        assert float((g1[name] - g).abs().max()) <= 1e-5, name


@pytest.mark.parametrize("price", ["narrow", "model"])
def test_the_packed_forward_folds_rows_and_takes_log_probs_at_response_positions_only(
    model: Any, monkeypatch: pytest.MonkeyPatch, price: str
) -> None:
    """Issue 39, item 3: the packed row is folded as `fold_layout` chose (so attention costs about N x W,
    not N x N), and the float32 vocabulary-wide log-softmax runs at the response positions only, not over
    the prompts; the log-probs are the padded forward's whichever layout was chosen."""
    from rlhf_trainer.workers import deepspeed_utils

    r = _rollout(int(model.config.vocab_size))
    lens = [int(x) for x in r.seq_lens]  # 14, 5, 29, 5, 8
    if price == "narrow":  # attention priced high: rows as wide as the longest sample, [29], [14, 8, 5], [5]
        monkeypatch.setattr(deepspeed_utils, "attention_tokens", lambda hidden: 1.0)
        expected = (3, max(lens))
    else:  # the tiny model's own price (hidden 128): 61 tokens cost least as one row
        expected = (1, sum(lens))
    fed: list[tuple[int, ...]] = []
    hook = model.register_forward_pre_hook(
        lambda _m, _a, kw: fed.append(tuple(kw["input_ids"].shape)), with_kwargs=True
    )
    softmaxed: list[tuple[int, ...]] = []
    real = algorithms.chunked_token_logprobs

    def spy(logits: torch.Tensor, *args: Any) -> Any:
        softmaxed.append(tuple(logits.shape))
        return real(logits, *args)

    monkeypatch.setattr(algorithms, "chunked_token_logprobs", spy)
    try:
        with torch.no_grad():
            out = deepspeed_utils.response_logprobs(
                model, r, 0, r.num_samples, 0, 1.0, None, 1.0, packed=True
            )
    finally:
        hook.remove()
    assert fed == [expected], (fed, lens)
    responses = int(r.response_lens.sum())
    assert softmaxed == [(responses, int(model.config.vocab_size))], (softmaxed, responses, sum(lens))
    assert torch.allclose(out.packed(), _padded(model, r), atol=1e-5)


def test_fold_row_keeps_samples_whole_longest_first() -> None:
    from rlhf_trainer.transfer import fold_row

    lens = torch.tensor([3, 2, 6, 1, 4])
    ids = torch.arange(1, int(lens.sum()) + 1)
    pos = torch.cat([torch.arange(int(n)) for n in lens])
    rows, row_pos, flat = fold_row(ids, pos, lens, attention_tokens=1.0)  # narrow rows: width 6
    # first-fit decreasing, by sample: 2 (6 tokens) | 4 (4), 1 (2) | 0 (3), 3 (1), 2 of padding
    assert rows.tolist() == [[6, 7, 8, 9, 10, 11], [13, 14, 15, 16, 4, 5], [1, 2, 3, 12, 0, 0]]
    assert row_pos.tolist() == [[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 0, 1], [0, 1, 2, 0, 0, 1]]
    assert torch.equal(rows.reshape(-1)[flat], ids)  # every token once, back in the packed row's order


def test_fold_layout_packs_longest_first_and_widens_rows_only_where_padding_costs_more() -> None:
    from rlhf_trainer.transfer import attention_tokens, first_fit_decreasing, fold_layout

    # in sample order these take 6 rows of 5 ([5] [2] [5] [2] [4] [4]); longest first, 5
    assert first_fit_decreasing([5, 2, 5, 2, 4, 4], 5) == [[0], [2], [4], [5], [1, 3]]
    skewed = [506, 40, 60, 80, 30, 50, 70, 40]  # 876 tokens: 2 rows of 506 pad 13 % of 1,012
    assert fold_layout(skewed, attention_tokens(256))[0] == 876  # one row: attention is cheap at 876
    assert fold_layout(skewed, attention_tokens(16))[0] == 506  # attention priced high: 2 narrow rows
    alike = [150] * 32  # nothing to pad: as narrow as the samples, whatever the price
    width, rows = fold_layout(alike, attention_tokens(512))
    assert (width, len(rows)) == (150, 32)


def test_packed_critic_forward_gives_the_padded_values_and_gradients(tmp_path: Path) -> None:
    from rlhf_trainer.tiny_model import make_tiny_model
    from rlhf_trainer.workers.deepspeed_utils import token_values
    from transformers import AutoModelForTokenClassification

    make_tiny_model(tmp_path)
    torch.manual_seed(5)
    critic: Any = AutoModelForTokenClassification.from_pretrained(
        str(tmp_path / "model"), num_labels=1, dtype=torch.float32
    ).eval()
    r = _rollout(int(critic.config.vocab_size))
    ret = torch.randn(int(r.response_lens.sum()), generator=torch.Generator().manual_seed(2))
    results = []
    for packed in (False, True):
        critic.zero_grad()
        out = token_values(critic, r, 0, r.num_samples, 0, None, packed=packed)
        tok = algorithms.value_loss_tokens(out.values, out.local(ret * 0.3), out.local(ret), 0.2)
        loss = algorithms.aggregate_loss(tok, out.mask, "seq-mean-token-mean")
        loss.backward()  # type: ignore[no-untyped-call]
        results.append(
            (float(loss.detach()), {n: p.grad.clone() for n, p in critic.named_parameters()}, out.packed())
        )
    (l0, g0, v0), (l1, g1, v1) = results
    assert abs(l0 - l1) <= 1e-5 and torch.allclose(v0, v1, atol=1e-5)
    for name, g in g0.items():
        assert float((g1[name] - g).abs().max()) <= 1e-5, name


def test_packing_falls_back_loudly_under_sequence_parallelism_and_on_a_leaking_model(
    model: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    from rlhf_trainer.sequence_parallel import SequenceParallel
    from rlhf_trainer.workers.deepspeed_utils import resolve_packing

    assert resolve_packing(model, {"packing": True}, None, "actor") is True
    assert resolve_packing(model, {"packing": False}, None, "actor") is False
    assert capsys.readouterr().err == ""
    sp = SequenceParallel(size=2, rank=0, dp_rank=0, dp_size=1)
    assert resolve_packing(model, {"packing": True}, sp, "critic") is False
    assert "trainer.packing is off for the critic: sequence parallelism" in capsys.readouterr().err

    class Leaking(torch.nn.Module):
        """A model that attends across packed samples (an attention mask defeats the detection)."""

        def __init__(self, inner: Any) -> None:
            super().__init__()
            self.inner, self.config = inner, inner.config

        def forward(self, input_ids: torch.Tensor, **kw: Any) -> Any:
            return self.inner(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), **kw)

    assert resolve_packing(Leaking(model), {"packing": True}, None, "reference") is False
    assert "does not keep packed samples apart" in capsys.readouterr().err


# ---- the trained roles on real DeepSpeed ZeRO-3 engines (one spawned rank), packed against padded ----
LENS = [(6, 60), (9, 3), (4, 5), (7, 2), (3, 41), (5, 4)]  # (prompt, response): skewed
VALID = [True, True, False, True, True, True]


def _packing_rank(rank: int, port: int, lm: str, critic: str, out: str) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1",
                       "LOCAL_RANK": "0", "DS_ACCELERATOR": "cpu"})  # fmt: skip
    torch.set_num_threads(1)
    from deepspeed.utils import safe_get_full_grad
    from rlhf_trainer.workers.deepspeed_utils import init_distributed
    from rlhf_trainer.workers.policy import PolicyLoss, PolicyModel
    from rlhf_trainer.workers.value import ValueModel

    init_distributed("gloo")
    g = torch.Generator().manual_seed(3)
    samples = []
    for p, n in LENS:
        ids = torch.randint(3, 500, (p + n,), generator=g).tolist()
        samples.append((ids[:p], ids[p:], (-torch.rand(n, generator=g)).tolist()))
    r = PackedRollout.from_samples(samples, groups=[0, 0, 0, 1, 1, 1])
    valid = torch.tensor(VALID)
    tokens = int(r.response_lens.sum())
    adv, noise = torch.randn(tokens, generator=g), 0.05 * torch.randn(tokens, generator=g)
    res: dict[str, Any] = {}
    for packing in (False, True):
        settings = {
            "path": lm, "rank": 0, "world_size": 1, "zero_stage": 3, "bf16": False, "offload": False,
            "gradient_checkpointing": False, "pad_id": 0, "lr_scheduler": "constant", "lr_warmup_steps": 0,
            "total_steps": 10, "train_micro_batch": 2, "temperature": 1.0, "lr": 1e-3, "grad_accum": 3,
            "packing": packing,
        }  # fmt: skip
        actor = PolicyModel(lm, settings)
        rows: list[tuple[int, ...]] = []  # every forward's input shape and its real (non-pad) tokens

        def record(_m: Any, _a: Any, kw: dict[str, Any], rows: list[tuple[int, ...]] = rows) -> None:
            rows.append((*kw["input_ids"].shape, int((kw["input_ids"] != 0).sum())))

        actor.engine.module.register_forward_pre_hook(record, with_kwargs=True)
        grads: dict[str, torch.Tensor] = {}
        step = actor.engine.step

        def recording_step(engine: Any = actor.engine, step: Any = step, grads: Any = grads) -> None:
            if not grads and engine.is_gradient_accumulation_boundary():
                for name, p in engine.module.named_parameters():
                    grads[name] = safe_get_full_grad(p).detach().clone()
            step()

        actor.engine.step = recording_step
        old = actor.logprobs(r, 2)
        loss = PolicyLoss(
            policy_loss="ppo", clip_low=0.2, clip_high=0.2, dual_clip=None, entropy_coef=0.01, kl_loss_coef=0.05,
            kl_estimator="k3", aggregation="seq-mean-token-mean", norm_constant=1.0, correction=None,
        )  # fmt: skip
        stats = actor.train(r, old + noise, adv, old - noise, valid, micro_batch=2, epochs=2, loss=loss)
        critic_model = ValueModel(critic, settings)
        values = critic_model.values(r, 2)
        cstats = critic_model.train(r, values, values + adv, valid, micro_batch=2, epochs=1, clip=0.2)
        res[f"packing={packing}"] = {"old": old, "stats": stats, "grads": grads, "rows": rows,
                                     "values": values, "value_loss": cstats["value_loss"],
                                     "on": (actor.packing, critic_model.packing)}  # fmt: skip
    torch.save(res, Path(out) / "packing.pt")


@pytest.fixture(scope="module")
def packing_steps(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("packing")
    critic = tiny_critic(tiny_model / "model", out)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run_ranks(_packing_rank, 1, (free_port(), str(tiny_model / "model"), str(critic), str(out)), timeout=300)
    res: dict[str, Any] = torch.load(out / "packing.pt")
    return res


def test_packed_training_on_zero3_matches_the_padded_step(packing_steps: dict[str, Any]) -> None:
    padded, packed = packing_steps["packing=False"], packing_steps["packing=True"]
    assert packed["on"] == (True, True) and padded["on"] == (False, False)
    total = sum(p + n for p, n in LENS)
    # packed: the rows hold every token once (3 old-log-prob + 6 training forwards), in fewer positions
    # than the padded micro-batches feed
    assert sum(real for *_, real in packed["rows"]) == 3 * total
    fed = sum(b * n for b, n, _ in packed["rows"])
    assert fed < sum(b * n for b, n, _ in padded["rows"]), (packed["rows"], padded["rows"])
    assert all(b == 2 for b, _, _ in padded["rows"])  # padded: micro-batches of trainMicroBatchSize samples
    assert len(packed["rows"]) == len(padded["rows"])
    assert torch.allclose(packed["old"], padded["old"], atol=1e-5)
    assert torch.allclose(packed["values"], padded["values"], atol=1e-5)
    assert packed["value_loss"] == pytest.approx(padded["value_loss"], abs=1e-5)
    for key, value in padded["stats"].items():
        if key != "seconds":
            assert packed["stats"][key] == pytest.approx(value, abs=1e-5), key
    assert sorted(packed["grads"]) == sorted(padded["grads"]) and len(padded["grads"]) > 10
    for name, g in padded["grads"].items():
        assert float((packed["grads"][name] - g).abs().max()) <= 1e-5, name
