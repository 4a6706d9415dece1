"""DeepSpeed plumbing shared by the actor, critic and reference: config, the one engine builder, forward passes.

Owns how an HF model becomes a DeepSpeed engine (HfDeepSpeedConfig before from_pretrained, so ZeRO-3
partitions at load; `build_engine` for every role) and how per-token log-probs/values come out of a
micro-batch, padded or packed (`trainer.packing`: one row, no padding). No Ray here.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from rlhf_trainer import algorithms, sequence_parallel
from rlhf_trainer.sequence_parallel import SequenceParallel, forward_context, gather_columns
from rlhf_trainer.startup_imports import hidden
from rlhf_trainer.transfer import (
    PackedRollout,
    attention_tokens,
    fold_row,
    pack_micro_batch,
    packed_rows,
    pad_micro_batch,
    pad_response_values,
    unpad_response_values,
)

# Parameters below this many elements stay whole on every rank (DeepSpeed's persistence threshold).
# DeepSpeed's default (1e5) would keep every tensor of a tiny model whole; overridable by env.
PERSISTENCE_THRESHOLD = int(os.environ.get("RLHF_ZERO3_PERSISTENCE_THRESHOLD", "10000"))


def ds_config(
    *,
    zero_stage: int,
    micro_batch: int,
    grad_accum: int,
    world_size: int,
    bf16: bool,
    offload: bool,
    train: bool,
    lr: float = 1e-6,
    use_client_optimizer: bool = True,
    memory_efficient_linear: bool = True,
) -> dict[str, Any]:
    """`memory_efficient_linear`: ZeRO-3's own linear (DeepSpeed's default), which replaces
    `torch.nn.functional.linear` for the whole process. On CPU it is a `matmul` over the 3-D input instead
    of torch's fused linear: a 1-rank ZeRO-3 training step took 17 % longer than plain torch's with it and
    9 % with torch's (benchmarks/zero3_linear.py): `build_engine` turns it off on CPU."""
    zero: dict[str, Any] = {
        "stage": zero_stage,
        "stage3_param_persistence_threshold": PERSISTENCE_THRESHOLD,
        "stage3_prefetch_bucket_size": 5e7,
        "reduce_bucket_size": 5e7,
        "memory_efficient_linear": memory_efficient_linear,
    }
    if offload:
        zero["offload_param"] = {"device": "cpu"}
        if train:
            zero["offload_optimizer"] = {"device": "cpu"}
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": grad_accum,
        "train_batch_size": micro_batch * grad_accum * world_size,
        "zero_optimization": zero,
        "bf16": {"enabled": bf16},
        "gradient_clipping": 1.0,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if offload and train:
        # Our AdamW is a client optimizer; DeepSpeed 0.19 refuses one under ZeRO-Offload unless told it is
        # meant (its DeepSpeedCPUAdam needs a compiled op). torch's AdamW steps the offloaded fp32 partitions.
        cfg["zero_force_ds_cpu_optimizer"] = False
    if train and not use_client_optimizer:
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": lr, "betas": [0.9, 0.95], "weight_decay": 0.0}}
    return cfg


def without_dropout(config: Any) -> Any:
    """`config` with every dropout probability set to 0 (attention_dropout, hidden_dropout,
    classifier_dropout, *_pdrop, ...), including the value head's: with no `classifier_dropout` in the
    config, transformers' token-classification head falls back to Dropout(0.1)."""
    for name in dir(config):
        if ("dropout" in name or name.endswith("_pdrop")) and not name.startswith("_"):
            value = getattr(config, name, None)
            if isinstance(value, float) or value is None:
                with contextlib.suppress(AttributeError):  # a read-only property
                    setattr(config, name, 0.0)
    config.classifier_dropout = 0.0
    return config


def disable_dropout(model: torch.nn.Module) -> torch.nn.Module:
    """Every nn.Dropout of `model` at p=0, as TRL's disable_dropout_in_model: the trained models (actor,
    critic) and the reference compute the same numbers in train() and eval() mode, so the training pass
    reproduces the old log-probs and values it is compared with (a PPO ratio of exactly 1 at first)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model


def load_hf_model(path: str, kind: str, cfg: dict[str, Any], dtype: torch.dtype) -> tuple[Any, Any]:
    """from_pretrained under HfDeepSpeedConfig (ZeRO-3 partitions while loading), dropout off (see
    disable_dropout); returns (model, keepalive)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification
    from transformers.integrations.deepspeed import HfDeepSpeedConfig

    # Must stay alive until deepspeed.initialize: transformers checks it through a weakref.
    keepalive = HfDeepSpeedConfig(cfg) if cfg["zero_optimization"]["stage"] == 3 else None  # type: ignore[no-untyped-call]
    if kind == "causal_lm":
        config = without_dropout(AutoConfig.from_pretrained(path))
        model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=dtype)
    elif kind == "value":
        config = without_dropout(AutoConfig.from_pretrained(path, num_labels=1))
        model = AutoModelForTokenClassification.from_pretrained(path, config=config, dtype=dtype)
    else:
        raise ValueError(kind)
    return disable_dropout(model), keepalive


def import_deepspeed() -> Any:
    """`import deepspeed`, without letting it import mlflow (`startup_imports.hidden`).

    DeepSpeed's autotuner (never run here) imports mlflow at import time whenever it is installed, and
    the trainer image has it for tracking, which only the driver does: measured 4.4 s of a 11.6 s
    `import deepspeed` on this machine, in every rank of every start-up. Its autotuner catches the
    ImportError.
    """
    if "deepspeed" in sys.modules:
        return sys.modules["deepspeed"]
    with hidden("mlflow"):
        import deepspeed
    return deepspeed


def init_distributed(backend: str) -> None:
    """DeepSpeed's process group, without its shared-memory all-reduce op.

    On the CPU accelerator DeepSpeed JIT-compiles `deepspeed_shm_comm` (g++, ninja) at every first
    start. That op serves inference all-reduce only; ZeRO-3 training never calls it. The build needs a
    compiler in the image, costs tens of seconds, and holds a file lock in the torch extensions cache:
    a rank killed mid-build (node loss, a preemption) leaves the lock behind and every later start waits
    on it forever. Marking the op incompatible makes DeepSpeed skip it.
    """
    deepspeed = import_deepspeed()
    ops = importlib.import_module("deepspeed.ops")

    ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)


def all_reduce_sum(values: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    """Sum of a small CPU tensor over every rank of the default process group (a copy; unchanged with
    one rank or no group). NCCL reduces device tensors only: pass the model's device there."""
    dist = torch.distributed
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return values.clone()
    on = values.to(device) if device is not None else values.clone()
    dist.all_reduce(on)
    return on.cpu()


def world_size() -> int:
    """Ranks of the default process group (1 without one): DeepSpeed averages gradients over them."""
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


@dataclass(frozen=True)
class BuiltEngine:
    """A role's DeepSpeed engine, with its optimizer and LR schedule (None for the frozen reference)."""

    engine: Any
    optimizer: Any
    scheduler: Any


def build_engine(
    path: str, settings: dict[str, Any], sp: SequenceParallel | None, *, head: str, train: bool
) -> BuiltEngine:
    """The one way a role's model becomes a DeepSpeed engine (actor and critic train, reference is frozen).

    head: "causal_lm" (actor, reference) or "value" (critic). A trained engine gets AdamW and the LR
    schedule of `settings`; a frozen one has no optimizer and no gradients.
    """
    deepspeed = import_deepspeed()

    dtype = torch.bfloat16 if settings["bf16"] else torch.float32
    cfg = ds_config(
        zero_stage=settings["zero_stage"],
        micro_batch=settings["train_micro_batch"],
        grad_accum=settings["grad_accum"] if train else 1,
        world_size=settings["world_size"],
        bf16=settings["bf16"],
        offload=settings["offload"],
        train=train,
        # On CPU, torch's own linear (ds_config); elsewhere DeepSpeed's default. Settings without a
        # device (tests that build engines directly) get DeepSpeed's default.
        memory_efficient_linear=settings.get("device") != "cpu",
    )
    model, keepalive = load_hf_model(path, head, cfg, dtype)
    sequence_parallel.enable(model, sp)
    if not train:
        model.requires_grad_(False)
        engine, *_ = deepspeed.initialize(model=model, config=cfg)
        del keepalive
        return BuiltEngine(engine, None, None)
    if settings.get("gradient_checkpointing"):
        model.gradient_checkpointing_enable()
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=settings["lr"], betas=(0.9, 0.95), weight_decay=0.0, eps=1e-8
    )
    schedule = algorithms.lr_lambda(
        settings["lr_scheduler"], settings["lr_warmup_steps"], settings["total_steps"]
    )

    def make_scheduler(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        return torch.optim.lr_scheduler.LambdaLR(opt, schedule)

    engine, optimizer, _, scheduler = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=make_scheduler, config=cfg
    )
    del keepalive
    return BuiltEngine(engine, optimizer, scheduler)


class ResponseScorer:
    """Log-probs of the response tokens under a causal LM role (actor, reference), in micro-batches."""

    engine: Any
    pad_id: int
    temperature: float  # the engines' sampling temperature (1 for greedy)
    sp: SequenceParallel | None
    top_p: float = 1.0  # the engines' nucleus (the actor's log-probs are over it; the reference's are not)
    packing: bool = False  # packed micro-batches (resolve_packing)

    @torch.no_grad()
    def logprobs(self, rollout: PackedRollout, micro_batch: int) -> torch.Tensor:
        def forward(s: int, e: int) -> TokenOutputs:
            return response_logprobs(
                self.engine, rollout, s, e, self.pad_id, self.temperature, self.sp, self.top_p,
                packed=self.packing,
            )  # fmt: skip

        return over_micro_batches(self.engine, rollout, micro_batch, forward, by_tokens=self.packing)


class TrainedRole:
    """Checkpoint and resume-check methods of a trained role (actor, critic) over its `BuiltEngine`."""

    engine: Any
    optimizer: Any
    scheduler: Any

    def save(self, directory: str, tag: str) -> None:
        self.engine.save_checkpoint(directory, tag=tag, save_latest=False)

    def load(self, directory: str, tag: str) -> None:
        path, _ = self.engine.load_checkpoint(
            directory, tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True
        )
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint {tag!r} under {directory}")

    def state_digest(self) -> dict[str, float]:
        return training_state_digest(self.optimizer, self.scheduler)


@dataclass
class TokenOutputs:
    """Per-position results of one micro-batch's forward, for the columns this rank computed.

    Without sequence parallelism the columns are all T-1 positions of the padded micro-batch; with it
    they are this rank's contiguous slice of the sequence padded to a multiple of the SP size.
    values/mask: [B, columns]; full_mask: the action mask of every column (all ranks).
    """

    values: torch.Tensor
    mask: torch.Tensor
    full_mask: torch.Tensor
    cols: slice
    sp: SequenceParallel | None = None
    entropy: torch.Tensor | None = None  # per position, of the sampling distribution (response_logprobs)

    def packed(self) -> torch.Tensor:
        """Packed response-token results of the whole micro-batch (gathered over the SP group: [B, T] floats)."""
        values = self.values.detach()
        if self.sp is not None:
            values = gather_columns(values, self.sp)
        return unpad_response_values(values, self.full_mask).cpu()

    def local(self, packed: torch.Tensor) -> torch.Tensor:
        """A packed per-token tensor of the micro-batch laid out like `values` (this rank's columns)."""
        mask = self.full_mask.cpu()
        return pad_response_values(packed, mask)[:, self.cols].to(self.values.device)


def _forward(
    model: torch.nn.Module,
    rollout: PackedRollout,
    start: int,
    end: int,
    pad_id: int,
    sp: SequenceParallel | None,
) -> tuple[Any, torch.Tensor, torch.Tensor, slice]:
    """One forward of samples [start, end): (model output, labels, action mask, columns), all for the
    positions this rank computes. With SP every rank sees the same token ids but embeds only its slice,
    with global position ids; the Ulysses attention is causal over the whole sequence (right padding
    keeps every real token's window free of padding)."""
    ids, attn, act = pad_micro_batch(rollout, start, end, pad_id)
    device = next(model.parameters()).device
    labels = torch.cat([ids[:, 1:], torch.full((ids.shape[0], 1), pad_id, dtype=ids.dtype)], dim=1)
    if sp is None or sp.size <= 1:
        width = ids.shape[1] - 1
        out = model(input_ids=ids.to(device), attention_mask=attn.to(device), use_cache=False)
        return out, labels[:, :width].to(device), act.to(device), slice(0, width)
    width = -(-ids.shape[1] // sp.size) * sp.size  # padded length T, a multiple of the SP size
    extra = width - ids.shape[1]
    ids = torch.nn.functional.pad(ids, (0, extra), value=pad_id)
    labels = torch.nn.functional.pad(labels, (0, extra), value=pad_id)
    act = torch.nn.functional.pad(act, (0, width - act.shape[1]), value=0.0)
    cols = sp.columns(width)
    positions = torch.arange(cols.start, cols.stop).unsqueeze(0).expand(ids.shape[0], -1)
    with forward_context(sp):
        out = model(input_ids=ids[:, cols].to(device), position_ids=positions.to(device), use_cache=False)
    return out, labels[:, cols].to(device), act.to(device), cols


def _packed_forward(
    model: torch.nn.Module, rollout: PackedRollout, start: int, end: int, *, responses_only: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One forward of samples [start, end) packed without padding (`pack_micro_batch`: back to back, position
    ids restarted per sample, no attention mask and no KV cache, so transformers keeps every sample's
    attention inside it), folded into rows (`fold_row`: first-fit decreasing, as wide as attention's cost allows): (logits [1, N, ...]
    in the one row's order, labels [1, N], action mask [B, T-1] as the padded path's, `packed_rows`' index
    and inside, which lay the row's per-position results out as the padded path's [B, T-1], and the row
    positions the logits were kept at). `responses_only`: the logits at the response positions only (`keep`),
    so the float32 vocabulary-wide log-softmax after them does not run over the prompts."""
    ids, pos, labels, act_row = pack_micro_batch(rollout, start, end)
    device = next(model.parameters()).device
    rows, row_pos, flat = fold_row(
        ids[0], pos[0], rollout.seq_lens[start:end], attention_tokens(hidden_size(model))
    )
    keep = act_row[0].nonzero().squeeze(1).to(device) if responses_only else None
    out = model(input_ids=rows.to(device), position_ids=row_pos.to(device), use_cache=False)
    wanted = flat.to(device) if keep is None else flat.to(device)[keep]
    logits = out.logits.reshape(-1, out.logits.shape[-1])[wanted].unsqueeze(0)
    index, inside = packed_rows(rollout, start, end)
    _, _, act = pad_micro_batch(rollout, start, end, 0)
    return logits, labels.to(device), act.to(device), index.to(device), inside.to(device), keep


def hidden_size(model: Any) -> int:
    """The transformer's hidden size, through a DeepSpeed engine (whose own `config` is DeepSpeed's)."""
    config = getattr(getattr(model, "module", model), "config", None)
    size = getattr(config, "hidden_size", None)
    if not isinstance(size, int) or size <= 0:
        raise ValueError(
            f"cannot fold packed rows: the model's config has no hidden_size ({type(config).__name__})"
        )
    return size


def _at_responses(values: torch.Tensor, act: torch.Tensor) -> torch.Tensor:
    """Per-response-token values [R] laid out as the padded micro-batch's [B, T-1] (0 where `act` is 0);
    differentiable."""
    return values.new_zeros(act.shape).masked_scatter(act.bool(), values)


def _rows(row: torch.Tensor, index: torch.Tensor, inside: torch.Tensor) -> torch.Tensor:
    """A packed row's per-position values [N] laid out as the padded micro-batch's [B, T-1] (0 outside a
    sample); differentiable."""
    return torch.where(inside, row[index], torch.zeros((), dtype=row.dtype, device=row.device))


def response_logprobs(
    model: torch.nn.Module,
    rollout: PackedRollout,
    start: int,
    end: int,
    pad_id: int,
    temperature: float = 1.0,
    sp: SequenceParallel | None = None,
    top_p: float = 1.0,
    entropy_grad: bool = False,
    *,
    packed: bool = False,
) -> TokenOutputs:
    """Log-probs of each next token, for samples [start, end) (this rank's columns under SP), under the
    distribution the engines sampled from (logits / temperature, renormalised over the top-p nucleus);
    `entropy` holds that distribution's entropy per position. `packed` (no SP): the forward runs over the
    samples packed in one row, the results come back in the padded layout (`_packed_forward`).

    Either way the float32 vocabulary-wide log-softmax runs only at the response positions (the action
    mask; under SP, those among this rank's columns), in chunks (`algorithms.chunked_token_logprobs`);
    every other position gets 0, as the packed layout always did, and every consumer masks by `mask`."""
    if packed:
        if sp is not None and sp.size > 1:
            raise ValueError("packed micro-batches need whole sequences (sequence parallelism pads)")
        logits, labels, act, _, _, keep = _packed_forward(model, rollout, start, end, responses_only=True)
        assert keep is not None  # logits at the response positions only: [1, R, V]
        lp, ent = algorithms.chunked_token_logprobs(
            logits[0], labels[0, keep], temperature, top_p, entropy_grad
        )
        # the response positions in row order are the action mask's in [B, T-1] order: scattered there
        lp, entropy = _at_responses(lp, act), _at_responses(ent, act)
        return TokenOutputs(lp, act, act, slice(0, act.shape[1]), None, entropy)
    out, labels, act, cols = _forward(model, rollout, start, end, pad_id, sp)
    local = act[:, cols]
    at = local.bool()
    # one gather of the response rows (in the model's dtype); the [B, columns, V] logits are then dropped
    logits = out.logits[:, : cols.stop - cols.start, :][at]
    del out
    lp, ent = algorithms.chunked_token_logprobs(logits, labels[at], temperature, top_p, entropy_grad)
    lp, entropy = _at_responses(lp, local), _at_responses(ent, local)
    return TokenOutputs(lp, local, act, cols, sp if sp is not None and sp.size > 1 else None, entropy)


def over_micro_batches(
    engine: Any,
    rollout: PackedRollout,
    micro_batch: int,
    forward: Callable[[int, int], TokenOutputs],
    by_tokens: bool = False,
) -> torch.Tensor:
    """Inference over a rollout in micro-batches: `forward(start, end)`'s packed outputs, concatenated.
    `by_tokens` (packing): the same number of micro-batches, balanced by tokens."""
    engine.eval()
    out = [forward(s, e).packed() for s, e in rollout.micro_batches(micro_batch, by_tokens)]
    return torch.cat(out) if out else torch.zeros(0)


def token_values(
    model: torch.nn.Module,
    rollout: PackedRollout,
    start: int,
    end: int,
    pad_id: int,
    sp: SequenceParallel | None = None,
    *,
    packed: bool = False,
) -> TokenOutputs:
    """Critic forward: V(state before each response token), for samples [start, end); `packed` as in
    response_logprobs."""
    if packed:
        if sp is not None and sp.size > 1:
            raise ValueError("packed micro-batches need whole sequences (sequence parallelism pads)")
        logits, _, act, index, inside, _ = _packed_forward(model, rollout, start, end)
        values = _rows(logits[0, :, 0].float(), index, inside)
        return TokenOutputs(values, act, act, slice(0, act.shape[1]))
    out, _, act, cols = _forward(model, rollout, start, end, pad_id, sp)
    values = out.logits[:, : cols.stop - cols.start, 0].float()
    return TokenOutputs(values, act[:, cols], act, cols, sp if sp is not None and sp.size > 1 else None)


def isolates_packed_samples(model: Any) -> bool:
    """Whether `model` keeps packed samples apart: a sample's logits in a packed row must not change when
    the sample before it does (transformers 5.x does so from restarted position ids, with no attention
    mask and no KV cache). Two tiny forwards, no gradient; collective under ZeRO-3 like any forward."""
    vocab = int(getattr(model, "module", model).config.vocab_size)  # a DeepSpeed engine wraps the model
    device = next(model.parameters()).device
    second = torch.arange(4, dtype=torch.int64) % vocab + 1
    pos = torch.cat([torch.arange(5), torch.arange(4)]).unsqueeze(0).to(device)
    logits = []
    for shift in (0, 3):
        first = (torch.arange(5, dtype=torch.int64) * 7 + shift) % vocab
        ids = torch.cat([first, second]).unsqueeze(0).to(device)
        with torch.no_grad():
            logits.append(model(input_ids=ids, position_ids=pos, use_cache=False).logits[0, 5:].float())
    scale = max(float(logits[0].abs().max()), 1.0)
    return float((logits[0] - logits[1]).abs().max()) <= 1e-3 * scale


def resolve_packing(engine: Any, settings: dict[str, Any], sp: SequenceParallel | None, role: str) -> bool:
    """Whether this role's micro-batches are packed: `trainer.packing` (settings["packing"]), except under
    sequence parallelism (its forward pads each sequence to a multiple of the group and splits columns) and
    for a model that does not keep packed samples apart (isolates_packed_samples). Both fall back to padded
    micro-batches, said on stderr (the driver log) and in the rank's setup result (placement logs it)."""
    if not settings.get("packing"):
        return False
    if sp is not None and sp.size > 1:
        reason = f"sequence parallelism (size {sp.size}) runs padded micro-batches"
    elif not isolates_packed_samples(engine):
        reason = "the model's attention does not keep packed samples apart (needs transformers' packed-"
        reason += "sequence detection: position ids, no attention mask)"
    else:
        return True
    print(f"trainer.packing is off for the {role}: {reason}", file=sys.stderr, flush=True)
    return False


def training_state_digest(optimizer: Any, scheduler: Any) -> dict[str, float]:
    """Numbers that change with this rank's training state, to check a resume restored all of it:
    the optimizer's own (fp32, ZeRO-partitioned) weights, its Adam moments, and the LR schedule."""
    opt = getattr(optimizer, "optimizer", optimizer)  # ZeRO wraps the client optimizer
    # ZeRO keeps its fp32 partitions itself (stage 3 hands them to the client optimizer only inside step)
    flat = getattr(optimizer, "fp32_partitioned_groups_flat", None) or getattr(
        optimizer, "single_partition_of_fp32_groups", None
    )
    weights = list(flat) if flat else [p for g in opt.param_groups for p in g["params"]]
    params = sum(float(p.detach().double().abs().sum()) for p in weights)
    moments = 0.0
    for state in opt.state.values():
        for key, v in state.items():
            if key != "step" and isinstance(v, torch.Tensor) and v.dtype.is_floating_point:
                moments += float(v.double().abs().sum())
    return {
        "params": params,
        "moments": moments,
        "lr": float(scheduler.get_last_lr()[0]) if scheduler is not None else 0.0,
        "scheduler_step": float(scheduler.last_epoch) if scheduler is not None else 0.0,
    }


def full_shape(p: torch.nn.Parameter) -> tuple[int, ...]:
    """The unpartitioned shape of a (possibly ZeRO-3 partitioned) parameter."""
    shape = getattr(p, "ds_shape", None)
    return tuple(int(d) for d in (shape if shape is not None else p.shape))
