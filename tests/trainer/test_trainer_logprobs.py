"""The trainer's log-probs (`deepspeed_utils.response_logprobs`, `algorithms.chunked_token_logprobs`), issue 39
item 3: the float32 vocabulary-wide log-softmax runs at the response positions only (padded and packed), in
chunks of positions, each checkpointed under a gradient. On the tiny Llama, with chunks smaller than the
response count: the log-probs, entropies and every parameter gradient equal the unchunked computation (the
code as it was), with temperature and top-p; the largest float32 vocabulary-wide tensor is one chunk's; no
prompt position reaches the log-softmax; nothing float32 and vocabulary-wide is kept for the backward."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from rlhf_trainer import algorithms
from rlhf_trainer.transfer import PackedRollout
from rlhf_trainer.workers import deepspeed_utils as du
from torch.utils._python_dispatch import TorchDispatchMode

pytestmark = pytest.mark.unit
ROWS = 4  # positions per chunk in these tests: the rollout below has 33 response tokens, so 9 chunks
# float32 on a 2-layer model: chunking changes no row's arithmetic (a log-softmax row is computed alone, and
# the lm_head's backward sees the same zeros off the responses), so only summation order could differ
TOL = 1e-6


@pytest.fixture
def small_chunks(model: Any, monkeypatch: pytest.MonkeyPatch) -> int:
    vocab = int(model.config.vocab_size)
    monkeypatch.setattr(algorithms, "LOGPROB_CHUNK_BYTES", ROWS * 4 * vocab)
    assert algorithms.logprob_chunk_rows(vocab) == ROWS
    return vocab


def _rollout(vocab: int, resp: tuple[int, ...] = (9, 2, 17, 4, 1)) -> PackedRollout:
    g = torch.Generator().manual_seed(0)
    samples = []
    for p, r in zip((5, 3, 12, 1, 7), resp, strict=True):  # ragged, long prompts beside short responses
        prompt = torch.randint(3, vocab, (p,), generator=g).tolist()
        response = torch.randint(3, vocab, (r,), generator=g).tolist()
        samples.append((prompt, response, [0.0] * r))
    return PackedRollout.from_samples(samples, list(range(len(resp))))


def _unchunked(
    model: Any, r: PackedRollout, packed: bool, temperature: float, top_p: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The computation as it was before chunking: one float32 log-softmax over all the logits the forward
    kept (padded: every position, prompts included), masked afterwards. (log-probs, entropy, mask)."""
    n = r.num_samples
    if packed:
        logits, labels, act, _, _, keep = du._packed_forward(model, r, 0, n, responses_only=True)
        assert keep is not None
        lp, ent = algorithms.token_logprobs(logits.float(), labels[:, keep], temperature, top_p, True)
        return du._at_responses(lp[0], act), du._at_responses(ent[0], act), act
    out, labels, act, cols = du._forward(model, r, 0, n, 0, None)
    lp, ent = algorithms.token_logprobs(out.logits[:, : cols.stop].float(), labels, temperature, top_p, True)
    return lp * act, ent * act, act


def _loss_and_grads(model: Any, lp: torch.Tensor, ent: torch.Tensor, mask: torch.Tensor) -> Any:
    g = torch.Generator().manual_seed(7)
    w_lp, w_ent = torch.randn(mask.shape, generator=g), torch.randn(mask.shape, generator=g)
    loss = ((lp * w_lp + 0.1 * ent * w_ent) * mask).sum()
    loss.backward()  # type: ignore[no-untyped-call]
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return float(loss.detach()), grads


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)], ids=["plain", "temp-top_p"])
def test_chunked_log_probs_entropy_and_gradients_equal_the_unchunked(
    model: Any, small_chunks: int, packed: bool, temperature: float, top_p: float
) -> None:
    r = _rollout(small_chunks)
    assert int(r.response_lens.sum()) > 2 * ROWS  # several chunks run
    model.zero_grad()
    ref_lp, ref_ent, act = _unchunked(model, r, packed, temperature, top_p)
    ref_loss, ref_grads = _loss_and_grads(model, ref_lp, ref_ent, act)
    out = du.response_logprobs(model, r, 0, r.num_samples, 0, temperature, None, top_p, True, packed=packed)
    assert out.entropy is not None and out.values.shape == ref_lp.shape and torch.equal(out.mask, act)
    at = act.bool()
    assert float((out.values - ref_lp).detach()[at].abs().max()) <= TOL
    assert float((out.entropy - ref_ent).detach()[at].abs().max()) <= TOL
    assert bool((out.values[~at] == 0).all()) and bool((out.entropy[~at] == 0).all())  # off the responses
    loss, grads = _loss_and_grads(model, out.values, out.entropy, out.mask)
    assert abs(loss - ref_loss) <= TOL * max(1.0, abs(ref_loss))
    assert sorted(grads) == sorted(ref_grads) and len(grads) > 10
    for name, g in ref_grads.items():
        assert float((grads[name] - g).abs().max()) <= TOL, name
    with torch.no_grad():  # the inference pass (old log-probs, reference) is the same numbers
        again = du.response_logprobs(model, r, 0, r.num_samples, 0, temperature, None, top_p, packed=packed)
    assert torch.equal(again.values, out.values.detach())


class _Float32VocabTensors(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Records every float32 tensor an op creates whose last dimension is the vocabulary (rows of it), and
    the rows each log-softmax runs over."""

    def __init__(self, vocab: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.vocab = vocab
        self.rows: list[int] = []
        self.log_softmax_rows: list[int] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.shape[-1:] == (self.vocab,):
                self.rows.append(t.numel() // self.vocab)
        if func is torch.ops.aten._log_softmax.default:
            self.log_softmax_rows.append(args[0].numel() // self.vocab)
        return out


@pytest.fixture
def bf16_model(model: Any) -> Iterator[Any]:
    """The tiny model in bfloat16, as trained: its own tensors are bf16, so any float32 vocabulary-wide
    tensor is the log-prob code's."""
    yield copy.deepcopy(model).to(torch.bfloat16)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_the_float32_vocabulary_wide_intermediates_are_one_chunk(
    bf16_model: Any, small_chunks: int, packed: bool, top_p: float
) -> None:
    """Forward and backward of the training pass: no float32 [*, V] tensor has more than ROWS rows."""
    r = _rollout(small_chunks)
    seen = _Float32VocabTensors(small_chunks)
    with seen:
        out = du.response_logprobs(bf16_model, r, 0, r.num_samples, 0, 0.7, None, top_p, True, packed=packed)
        assert out.entropy is not None
        ((out.values + out.entropy) * out.mask).sum().backward()  # type: ignore[no-untyped-call]
    bf16_model.zero_grad()
    assert seen.rows and max(seen.rows) <= ROWS, max(seen.rows)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_no_prompt_position_reaches_the_log_softmax(bf16_model: Any, small_chunks: int, packed: bool) -> None:
    r = _rollout(small_chunks)
    seen = _Float32VocabTensors(small_chunks)
    with torch.no_grad(), seen:
        du.response_logprobs(bf16_model, r, 0, r.num_samples, 0, 1.0, None, 1.0, packed=packed)
    assert sum(seen.log_softmax_rows) == int(r.response_lens.sum()), seen.log_softmax_rows


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_the_backward_keeps_no_float32_log_softmax(bf16_model: Any, small_chunks: int, packed: bool) -> None:
    """Checkpointed chunks: what autograd keeps for the backward holds no float32 vocabulary-wide tensor
    (without the checkpoint every chunk's float32 log-softmax would be kept until the backward)."""
    r = _rollout(small_chunks)
    kept: list[tuple[torch.dtype, tuple[int, ...]]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        kept.append((t.dtype, tuple(t.shape)))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = du.response_logprobs(bf16_model, r, 0, r.num_samples, 0, 0.7, None, 0.9, True, packed=packed)
    assert out.entropy is not None and out.values.requires_grad
    wide = [k for k in kept if k[0] == torch.float32 and k[1] and k[1][-1] == small_chunks]
    assert kept and not wide, wide


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_a_micro_batch_without_response_tokens_still_runs_the_backward(
    model: Any, small_chunks: int, packed: bool
) -> None:
    """No response position (under SP: a rank whose columns are all prompt): the log-probs stay attached to
    the model's graph, so the backward (and its collectives under ZeRO-3 / SP) still runs, with zero grads."""
    r = _rollout(small_chunks, resp=(0, 0, 0, 0, 0))
    model.zero_grad()
    out = du.response_logprobs(model, r, 0, r.num_samples, 0, 1.0, None, 1.0, True, packed=packed)
    assert not bool(out.mask.any()) and out.values.requires_grad
    (out.values * out.mask).sum().backward()  # type: ignore[no-untyped-call]
    head = model.get_output_embeddings().weight.grad
    assert head is not None and not bool(head.any())
    model.zero_grad()
