"""Offline tiny model factory: a Llama-shaped model, a 512-token BPE tokenizer and a prompt dataset.

Owns building them from nothing (no download) and saving them in HF format so vLLM and DeepSpeed load
them through their real loading code. Must not import Ray, vLLM or DeepSpeed.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

# Syllables of a made-up language: enough structure for BPE merges, vowels and consonants mixed so
# the tiny task's reward (share of vowels) starts in the middle of its range.
_ONSETS = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "st", "tr", "pl", "kr"]
_NUCLEI = ["a", "e", "i", "o", "u", "ai", "ou", "ea", "io"]
_CODAS = ["", "", "n", "s", "t", "r", "l", "ng", "rk", "st"]

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]


@dataclass(frozen=True)
class TinyModelShape:
    """Shape of the tiny Llama. head_dim stays 64: vLLM's CPU attention rejects small head sizes."""

    vocab_size: int = 512
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    head_dim: int = 64
    max_position_embeddings: int = 512
    initializer_range: float = 0.02


def _word(rng: random.Random) -> str:
    return "".join(
        rng.choice(_ONSETS) + rng.choice(_NUCLEI) + rng.choice(_CODAS) for _ in range(rng.randint(1, 3))
    )


def synthetic_sentences(n: int, seed: int) -> list[str]:
    """Sentences of made-up words, used to train the BPE tokenizer and as prompts."""
    rng = random.Random(seed)
    return [" ".join(_word(rng) for _ in range(rng.randint(3, 9))) for _ in range(n)]


def build_tokenizer(vocab_size: int, seed: int = 0) -> object:
    """Train a BPE tokenizer (Metaspace pre-tokenizer, so decoding restores spaces) offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False)
    tok.train_from_iterator(synthetic_sentences(4000, seed), trainer=trainer)
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        model_max_length=512,
    )


EVAL_PROMPTS = 16  # the tiny task's evaluation split (eval.jsonl): half `short`, half `long`


def make_tiny_model(
    out_dir: str | Path,
    *,
    shape: TinyModelShape | None = None,
    num_prompts: int = 2048,
    seed: int = 0,
) -> dict[str, str]:
    """Write `model/` (HF Llama + tokenizer), `prompts.jsonl` and an evaluation split `eval.jsonl` (prompts
    not in prompts.jsonl's draw, with a `data_source` column: `short` prompts of 2 words, `long` of 3 to 5) under
    out_dir; return their paths."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = shape or TinyModelShape()
    out = Path(out_dir)
    model_dir = out / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(shape.vocab_size, seed)
    vocab = len(tokenizer)  # type: ignore[arg-type]
    if vocab > shape.vocab_size:
        raise ValueError(f"tokenizer has {vocab} tokens, more than vocab_size {shape.vocab_size}")
    config = LlamaConfig(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_attention_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=shape.max_position_embeddings,
        initializer_range=shape.initializer_range,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,  # type: ignore[attr-defined]
        bos_token_id=tokenizer.bos_token_id,  # type: ignore[attr-defined]
        eos_token_id=tokenizer.eos_token_id,  # type: ignore[attr-defined]
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)  # type: ignore[no-untyped-call]
    model.save_pretrained(model_dir, safe_serialization=True)
    tokenizer.save_pretrained(model_dir)  # type: ignore[attr-defined]

    prompts_path = out / "prompts.jsonl"
    rng = random.Random(seed + 1)
    with prompts_path.open("w") as f:
        for sentence in synthetic_sentences(num_prompts, seed + 2):
            words = sentence.split()[: rng.randint(2, 5)]
            f.write(json.dumps({"prompt": " ".join(words)}) + "\n")
    eval_path = out / "eval.jsonl"
    with eval_path.open("w") as f:
        for i, sentence in enumerate(synthetic_sentences(EVAL_PROMPTS, seed + 3)):
            source, length = ("short", 2) if i % 2 == 0 else ("long", 5)
            f.write(json.dumps({"prompt": " ".join(sentence.split()[:length]), "data_source": source}) + "\n")
    return {"model": str(model_dir), "prompts": str(prompts_path), "eval": str(eval_path)}
