"""Export a checkpoint's actor as a Hugging Face model directory: safetensors shards with their index, config, tokenizer.

Owns reading one ZeRO-3 checkpoint's actor (the fp32 master weights) tensor by tensor into bounded shards
that load in transformers and vLLM, written atomically; and where the driver's export runs
(`export_on_trainer`: a Ray task on a trainer node, never the driver's process). Must not start Ray, train,
nor hold the whole model.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import sys
import uuid
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rlhf_api.constants import TRAINER_RESOURCE

from rlhf_trainer.checkpoint import STATE_FILE, CheckpointStore
from rlhf_trainer.config import InputError
from rlhf_trainer.export_upload import FIELD as UPLOAD_FIELD
from rlhf_trainer.export_upload import Progress, UploadError, upload_export
from rlhf_trainer.object_store import ObjectStoreError, parse_s3_url
from rlhf_trainer.object_store import client as object_store_client

EXPORT_INFO = "rlhf_export.json"
INDEX_FILE = "model.safetensors.index.json"
# The exporting process holds one output shard (plus the tensor being cast) at a time.
DEFAULT_MAX_SHARD_BYTES = 2 * 2**30
# The export task reserves no CPU: the ranks keep theirs (idle while the driver waits on the export), and
# a job's placement may have reserved every CPU of the node, where any reservation would wait forever.
EXPORT_TASK_CPUS = 0.0


@dataclass(frozen=True)
class Exported:
    path: Path
    step: int
    base: str
    tensors: int
    dtype: str
    shards: int
    pid: int  # the process that read the checkpoint and wrote the shards, and its host
    host: str


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


def plan_shards(sizes: Mapping[str, int], max_shard_bytes: int) -> list[list[str]]:
    """The names in order, cut into shards of at most `max_shard_bytes` (a bigger tensor gets its own)."""
    shards: list[list[str]] = []
    used = 0
    for name, size in sizes.items():
        if not shards or used + size > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def export_actor(
    checkpoint: Path,
    outdir: Path,
    base: str | None = None,
    dtype: str | None = None,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Exported:
    """Write the actor of `checkpoint` to `outdir` (replaced whole if it exists); returns what was written.

    `base`: the model directory whose config and tokenizer the actor was trained from (default: the
    checkpoint's recorded `model.actor`). `dtype`: float32, bfloat16 or float16 (default: the base
    config's own dtype). The weights go to `model-0000i-of-0000N.safetensors`, each at most
    `max_shard_bytes` (unless one tensor is bigger), named in `model.safetensors.index.json`.
    """
    import torch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    step, path, state = find_checkpoint(checkpoint)
    base = base or (state.get("identity") or {}).get("model.actor")
    if not base:
        raise InputError(f"{path}: the checkpoint does not record its base model; pass --base MODEL_DIR")
    if not (path / "actor").is_dir():
        raise InputError(f"{path}: no actor shards (actor/) in this checkpoint")
    config = AutoConfig.from_pretrained(base)
    torch_dtype = getattr(torch, dtype) if dtype else (getattr(config, "dtype", None) or torch.float32)
    if isinstance(torch_dtype, str):
        torch_dtype = getattr(torch, torch_dtype)
    # Lazy: each tensor is gathered from the ranks' fp32 partitions (memory-mapped) when it is asked for.
    lazy = get_fp32_state_dict_from_zero_checkpoint(str(path), tag="actor", lazy_mode=True)
    with torch.device("meta"):  # the architecture's names and generation defaults; nothing allocated
        skeleton = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    expected = set(skeleton.state_dict())
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    missing, unexpected = sorted(expected - tied - set(lazy)), sorted(set(lazy) - expected)
    if missing or unexpected:
        raise InputError(
            f"{path}: the actor's weights do not fit {base}'s architecture "
            f"(missing {missing[:5]}, unexpected {unexpected[:5]})"
        )

    def cast_to(t: Any) -> Any:
        return torch_dtype if t.dtype.is_floating_point else t.dtype

    names = [n for n in lazy if n not in tied]  # a tied lm_head is the embedding: written once
    sizes = {n: lazy[n].shape.numel() * cast_to(lazy[n]).itemsize for n in names}
    shards = plan_shards(sizes, max_shard_bytes)
    outdir = outdir.resolve()
    outdir.parent.mkdir(parents=True, exist_ok=True)
    tmp = outdir.parent / f".tmp-{outdir.name}-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        weight_map: dict[str, str] = {}
        for i, shard in enumerate(shards, 1):
            file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            tensors = {n: lazy[n].contiguous().to(cast_to(lazy[n])).contiguous() for n in shard}
            save_file(tensors, str(tmp / file), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, file))
            del tensors
        index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
        (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        config.dtype = torch_dtype
        config.architectures = [type(skeleton).__name__]
        config.save_pretrained(tmp)
        if skeleton.can_generate():
            skeleton.generation_config.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(base).save_pretrained(tmp)
        info = {"checkpoint": str(path), "step": step, "job": state.get("job"), "base": base}
        (tmp / EXPORT_INFO).write_text(json.dumps(info, indent=1) + "\n")
        if outdir.exists():
            shutil.rmtree(outdir)
        os.rename(tmp, outdir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    name = str(torch_dtype).removeprefix("torch.")
    return Exported(outdir, step, base, len(names), name, len(shards), os.getpid(), socket.gethostname())


def export_on_trainer(
    checkpoint: Path, outdir: Path, *, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
) -> Exported:
    """`export_actor` as a Ray task on a trainer node (the checkpoint volume is mounted there, and the
    memory for a model is), never in this process: the caller (the driver, on the head) only waits for
    the small `Exported`. Ray must be connected.

    The task is pinned to a node that has the trainer resource (a KubeRay trainer worker), not given a
    share of that resource: the actor's ranks hold every trainer slot while a run exports, so asking for
    one would never be granted. Without such a node (a local Ray), it goes wherever Ray puts it.
    """
    import ray

    task = ray.remote(export_actor).options(  # type: ignore[attr-defined]
        num_cpus=EXPORT_TASK_CPUS,
        scheduling_strategy=_trainer_node(),
        max_retries=0,  # a failed export is reported, not silently run twice
        runtime_env={"env_vars": {"DS_ACCELERATOR": "cpu"}},  # it reads files: no device needed
    )
    try:
        ref = task.remote(checkpoint, outdir, max_shard_bytes=max_shard_bytes)  # type: ignore[call-arg]
        return ray.get(ref)  # type: ignore[no-any-return]
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, InputError):  # a bad checkpoint or base: the same error as in-process
            raise e.cause from None
        raise


def _trainer_node() -> Any:
    """A node with the trainer resource (a KubeRay trainer worker: the checkpoint volume is mounted
    there), pinned to rather than asked a share of; without one (a local Ray), Ray's default."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    trainers = [
        n["NodeID"]
        for n in ray.nodes()  # type: ignore[no-untyped-call]
        if n.get("Alive") and n.get("Resources", {}).get(TRAINER_RESOURCE, 0) > 0
    ]
    return NodeAffinitySchedulingStrategy(trainers[0], soft=False) if trainers else "DEFAULT"


class _Uploader:
    """The upload of an export directory, in a Ray actor on a trainer node (where the export is): one
    thread uploads, another answers `progress` for the driver's metrics."""

    def __init__(self, uri: str) -> None:
        self.state = Progress(uri)

    def upload(self, directory: str, step: int) -> dict[str, Any]:
        try:
            prefix = parse_s3_url(self.state.uri, UPLOAD_FIELD)
            upload_export(object_store_client(), Path(directory), prefix, step=step, progress=self.state)
        except (UploadError, ObjectStoreError) as e:
            self.state.error = str(e)
        return asdict(self.state)

    def progress(self) -> dict[str, Any]:
        return asdict(self.state)


def upload_on_trainer(
    directory: Path,
    uri: str,
    step: int,
    on_progress: Callable[[dict[str, Any]], None],
    poll_seconds: float = 1.0,
) -> dict[str, Any]:
    """Upload an export directory to `uri` (checkpoint.exportTo) from a trainer node, `on_progress`
    called with the progress (export_upload.Progress as a dict) every `poll_seconds` and at the end.
    Never raises for a failed upload: the result's `error` says why, and the local export is untouched."""
    import ray

    actor_class: Any = ray.remote(_Uploader).options(  # type: ignore[attr-defined]
        num_cpus=EXPORT_TASK_CPUS, scheduling_strategy=_trainer_node(), max_concurrency=2, max_restarts=0
    )
    actor: Any = actor_class.remote(uri)
    try:
        ref = actor.upload.remote(str(directory), step)
        while not ray.wait([ref], timeout=poll_seconds)[0]:
            on_progress(ray.get(actor.progress.remote()))
        result: dict[str, Any] = ray.get(ref)
    except ray.exceptions.RayError as e:  # the actor or its node died: reported like a failed upload
        result = asdict(Progress(uri, error=f"{UPLOAD_FIELD} {uri}: the upload's Ray actor failed: {e}"))
    finally:
        ray.kill(actor)
    on_progress(result)
    return result


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
    print(
        f"exported step {out.step} ({out.tensors} tensors, {out.dtype}, {out.shards} shard(s)) of {out.base} "
        f"to {out.path}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
