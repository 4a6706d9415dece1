"""Export a checkpoint's actor as a Hugging Face model directory: safetensors, config, tokenizer.

Owns turning one ZeRO-3 checkpoint's actor shards (the fp32 master weights) into a model that loads in
transformers and vLLM, written atomically beside or away from the checkpoints (`rlhf export`, and the
driver at the end of a run). Must not start Ray or train; reads only the files it is given.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlhf_trainer.checkpoint import STATE_FILE, CheckpointStore
from rlhf_trainer.config import InputError

EXPORT_INFO = "rlhf_export.json"


@dataclass(frozen=True)
class Exported:
    path: Path
    step: int
    base: str
    tensors: int
    dtype: str


def find_checkpoint(path: Path) -> tuple[int, Path, dict[str, Any]]:
    """A complete step directory, or the newest complete one under a checkpoint.path."""
    state_file = path / STATE_FILE
    if state_file.is_file():
        state = json.loads(state_file.read_text())
        if not state.get("complete"):
            raise InputError(f"{path}: an incomplete checkpoint (its write was interrupted); pick another")
        return int(state.get("step", 0)), path, state
    latest = CheckpointStore(path).latest()
    if latest is None:
        raise InputError(f"{path}: no complete checkpoint here (expected step-NNNNNNNN/{STATE_FILE})")
    return latest


def export_actor(
    checkpoint: Path, outdir: Path, base: str | None = None, dtype: str | None = None
) -> Exported:
    """Write the actor of `checkpoint` to `outdir` (replaced whole if it exists); returns what was written.

    `base`: the model directory whose config and tokenizer the actor was trained from (default: the
    checkpoint's recorded `model.actor`). `dtype`: float32, bfloat16 or float16 (default: the base
    config's own dtype).
    """
    import torch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    step, path, state = find_checkpoint(checkpoint)
    base = base or (state.get("identity") or {}).get("model.actor")
    if not base:
        raise InputError(f"{path}: the checkpoint does not record its base model; pass --base MODEL_DIR")
    if not (path / "actor").is_dir():
        raise InputError(f"{path}: no actor shards (actor/) in this checkpoint")
    config = AutoConfig.from_pretrained(base)
    torch_dtype = getattr(torch, dtype) if dtype else (getattr(config, "torch_dtype", None) or torch.float32)
    if isinstance(torch_dtype, str):
        torch_dtype = getattr(torch, torch_dtype)
    weights = get_fp32_state_dict_from_zero_checkpoint(str(path), tag="actor")
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)  # type: ignore[no-untyped-call]
    result = model.load_state_dict(weights, strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if set(result.missing_keys) - tied or result.unexpected_keys:
        raise InputError(
            f"{path}: the actor's weights do not fit {base}'s architecture "
            f"(missing {sorted(set(result.missing_keys) - tied)[:5]}, unexpected {result.unexpected_keys[:5]})"
        )
    model = model.to(torch_dtype)
    outdir = outdir.resolve()
    outdir.parent.mkdir(parents=True, exist_ok=True)
    tmp = outdir.parent / f".tmp-{outdir.name}-{uuid.uuid4().hex[:8]}"
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        AutoTokenizer.from_pretrained(base).save_pretrained(tmp)
        info = {"checkpoint": str(path), "step": step, "job": state.get("job"), "base": base}
        (tmp / EXPORT_INFO).write_text(json.dumps(info, indent=1) + "\n")
        if outdir.exists():
            shutil.rmtree(outdir)
        os.rename(tmp, outdir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Exported(outdir, step, base, len(weights), str(torch_dtype).removeprefix("torch."))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="rlhf export",
        description="Export a checkpoint's actor as a Hugging Face model directory (safetensors, config, "
        "tokenizer) that loads in transformers and vLLM.",
    )
    p.add_argument("checkpoint", help="a step-NNNNNNNN directory, or a checkpoint.path (its newest)")
    p.add_argument("outdir", help="the model directory to write (replaced if it exists)")
    p.add_argument("--base", help="the actor's base model directory (default: recorded in the checkpoint)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default: the base's dtype")
    args = p.parse_args(argv)
    try:
        out = export_actor(Path(args.checkpoint), Path(args.outdir), args.base, args.dtype)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"exported step {out.step} ({out.tensors} tensors, {out.dtype}) of {out.base} to {out.path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
