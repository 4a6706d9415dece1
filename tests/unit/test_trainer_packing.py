"""Packed micro-batches (issue 39, item 2, the layout): samples back to back in one row with position ids
restarted per sample give, on a real model (the tiny Llama, transformers' own attention), the same
response log-probs as the padded batch; without the restart, or with an attention mask that turns the
packed-sample detection off, they do not (nor with a KV cache: transformers detects packing only without
one, so every forward here passes use_cache=False, as the trainer's do). Not yet used by the trainer
(`trainer.packing` is still read by nothing)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from rlhf_trainer.transfer import PackedRollout, pack_micro_batch, pad_micro_batch, unpad_response_values

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from rlhf_trainer.tiny_model import make_tiny_model
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("tiny")
    make_tiny_model(out)
    loaded: Any = AutoModelForCausalLM.from_pretrained(str(Path(out) / "model"), dtype=torch.float32)
    return loaded.eval()


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
