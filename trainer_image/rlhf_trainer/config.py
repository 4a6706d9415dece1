"""The trainer's input: the RLHFJob spec parsed and checked, and the settings derived from it.

Owns spec parsing (validated as the API server does), the checks that need this machine's files, and
the plain dicts the spec becomes for the ranks, engines and advantage code. Must not start Ray or place
anything: every function here is pure or reads local files.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path
from typing import Any

import yaml
from rlhf_api.rules import violated
from rlhf_api.spec import RLHFJobSpec
from rlhf_api.validate import has_chat_template, runtime_issues, schema_issues, validate_manifest

from rlhf_trainer.agents.contract import AgentSetupError, load_agent_function
from rlhf_trainer.data import DatasetError, EvalPrompts, PromptDataset
from rlhf_trainer.device import DeviceInfo
from rlhf_trainer.workers.reward import RewardSetupError, load_reward_function


class InputError(ValueError):
    """A bad input caught before any heavy work starts; the message names the field/path/function."""


def parse_spec(data: dict[str, Any]) -> RLHFJobSpec:
    """An RLHFJobSpec (or a whole RLHFJob manifest) -> RLHFJobSpec, validated like the API server does."""
    if "spec" in data and "kind" in data:
        issues = validate_manifest(data)
        if issues:
            raise InputError("spec fails validation:\n" + "\n".join(f"  {i}" for i in issues))
        return RLHFJobSpec.model_validate(data["spec"], by_alias=True, by_name=False)
    issues = schema_issues(RLHFJobSpec, data, ("spec",))
    if issues:
        raise InputError("spec fails validation:\n" + "\n".join(f"  {i}" for i in issues))
    spec = RLHFJobSpec.model_validate(data, by_alias=True, by_name=False)
    problems = violated(spec)
    if problems:
        raise InputError(
            "spec fails validation:\n" + "\n".join(f"  {r.field_path}: {r.message}" for r in problems)
        )
    return spec


def load_spec_arg(args: argparse.Namespace) -> RLHFJobSpec:
    """The spec from --spec-json, --spec-env (the operator) or --spec-file."""
    if args.spec_json:
        raw = args.spec_json
    elif args.spec_env:
        raw = os.environ.get(args.spec_env, "")
        if not raw:
            raise InputError(f"--spec-env {args.spec_env}: environment variable is empty or unset")
    elif args.spec_file:
        try:
            return parse_spec(yaml.safe_load(Path(args.spec_file).read_text()))
        except OSError as e:
            raise InputError(f"--spec-file {args.spec_file}: cannot read: {e.strerror or e}") from e
    else:
        raise InputError("one of --spec-json, --spec-env, --spec-file is required")
    try:
        return parse_spec(json.loads(raw))
    except json.JSONDecodeError as e:
        raise InputError(f"spec JSON is malformed: {e}") from e


def preflight(spec: RLHFJobSpec) -> PromptDataset:
    """Before Ray starts: the checks that need files (rlhf_api.validate.runtime_issues; the batch geometry
    is an admission rule), then the prompt dataset and the reward function, loaded with precise messages."""
    issues = runtime_issues(spec)
    if issues:
        raise InputError("\n".join(str(issue) for issue in issues))
    d = spec.data
    try:
        data = PromptDataset(d.prompts, d.input_key, d.label_key, spec.algorithm.seed)
        if d.eval is not None:
            data.eval_split = EvalPrompts(d.eval.prompts, d.input_key, d.label_key, d.eval.max_prompts)
    except DatasetError as e:
        raise InputError(f"spec.{e}") from e
    for field, path, where in (
        ("data.prompts", d.prompts, data.first_chat),
        (
            "data.eval.prompts",
            d.eval.prompts if d.eval else "",
            data.eval_split and data.eval_split.first_chat,
        ),
    ):
        if where and not has_chat_template(Path(spec.model.actor)):
            raise InputError(
                f"spec.{field} {path}: {where}: a chat-message prompt needs the actor's chat template, and "
                f"its tokenizer ({spec.model.actor}) has none"
            )
    if spec.model.reward.type == "function":
        try:
            load_reward_function(str(spec.model.reward.function))
        except RewardSetupError as e:
            raise InputError(f"spec.{e}") from e
    if spec.rollout.agent is not None:  # loaded again by the agent runner; here its error is an input error
        try:
            load_agent_function(spec.rollout.agent.function)
        except AgentSetupError as e:
            raise InputError(f"spec.{e}") from e
    return data


def data_parallel_size(spec: RLHFJobSpec, ranks: int) -> int:
    """Data-parallel groups of a model group with `ranks` ranks: each SP block is one (sees one shard)."""
    return int(ranks // spec.trainer.sequence_parallel_for(ranks))


def mini_batch_micro_batches(samples: int, mini_batches: int, micro_batch: int) -> int:
    """Micro-batches in each of `mini_batches` equal mini-batches of `samples` (DeepSpeed's gradient
    accumulation steps; admission makes `mini_batches` divide `samples` on every rank)."""
    return max(1, math.ceil(samples // max(1, mini_batches) / micro_batch))


# ---------------------------------------------------------------------------- settings derived from the spec


def model_settings(spec: RLHFJobSpec, pad_id: int) -> dict[str, dict[str, Any]]:
    """{role: settings} for the ranks' DeepSpeed engines (actor, reference, critic if any)."""
    a = spec.algorithm
    base = {
        "zero_stage": spec.trainer.zero_stage,
        "bf16": bool(spec.trainer.bf16),
        "offload": spec.trainer.offload,
        "gradient_checkpointing": spec.trainer.gradient_checkpointing,
        "pad_id": int(pad_id),
        "lr_scheduler": a.lr_scheduler,
        # the schedule counts optimizer steps: epochs x mini-batches of them per step
        "lr_warmup_steps": a.lr_warmup_steps * a.epochs * a.mini_batches_per_epoch,
        "total_steps": a.total_steps * a.epochs * a.mini_batches_per_epoch,
        "train_micro_batch": a.train_micro_batch_size,
        # packed micro-batches (deepspeed_utils.resolve_packing: off under sequence parallelism)
        "packing": bool(spec.trainer.packing),
        # log-probs of the distribution the engines sampled from (logits / T); greedy (T=0) -> 1
        "temperature": float(spec.rollout.temperature) if spec.rollout.temperature > 0 else 1.0,
    }

    def grad_accum(world: int) -> int:
        """Micro-batches per optimizer step: one mini-batch of this group's share (every rank of an SP
        block runs all of its block's samples, its columns of each)."""
        local = a.samples_per_step // data_parallel_size(spec, world)
        return mini_batch_micro_batches(local, a.mini_batches_per_epoch, a.train_micro_batch_size)

    out = {
        "actor": {
            **base,
            "path": spec.model.actor,
            "lr": a.actor_learning_rate,
            # the actor's log-probs are over the nucleus the engines sample from (vLLM's processed log-probs
            # are renormalised over it); the reference's stay over the whole vocabulary: the KL is the
            # sampling policy's against it
            "top_p": float(spec.rollout.top_p),
            "grad_accum": grad_accum(spec.trainer.actor.ranks),
        },
        "reference": {**base, "path": spec.model.reference_path, "lr": 0.0, "grad_accum": 1},
    }
    if spec.model.critic:
        out["critic"] = {
            **base,
            "path": spec.model.critic,
            "lr": a.critic_learning_rate,
            "grad_accum": grad_accum(spec.trainer.placement("critic").ranks),
        }
    return out


def algorithm_wire(spec: RLHFJobSpec) -> dict[str, Any]:
    """The advantage and loss settings the actor and critic ranks read each step (the driver replaces
    `kl_coef` by the adaptive controller's and adds `score_moments` for running normalisation)."""
    a = spec.algorithm
    c, shaping = a.rollout_correction, a.reward_shaping
    return {
        "estimator": a.advantage_estimator,
        "grpo_scale": a.grpo_std_normalization,
        "kl_coef": a.kl_coef if a.uses_reference else 0.0,
        "kl_in_loss": a.uses_reference and not a.kl_in_reward,
        "kl_reward_estimator": a.kl_estimator_reward,
        "kl_loss_estimator": a.kl_estimator_loss,
        "gamma": a.gamma,
        "lam": a.lam,
        "policy_loss": a.policy_loss,
        "clip_low": a.clip_range_low if a.clip_range_low is not None else a.clip_range,
        "clip_high": a.clip_range_high if a.clip_range_high is not None else a.clip_range,
        "dual_clip": a.dual_clip,
        "entropy_coef": a.entropy_coef,
        "value_clip": a.value_clip_range,
        "epochs": a.epochs,
        "mini_batches": a.mini_batches_per_epoch,
        "loss_aggregation": a.loss_aggregation,
        "norm_constant": float(a.max_response_length),  # seq-mean-token-sum-norm (Dr. GRPO)
        "train_micro_batch": a.train_micro_batch_size,
        "skip_old_logprobs": a.old_logprobs_redundant,
        # pi_prox / pi_behav per token (algorithms.rollout_weights): the kernels' gap, and in async mode the
        # weights one step older too
        "correction": {"level": c.level, "mode": c.mode, "lower": c.lower_bound, "upper": c.upper_bound}
        if c.enabled
        else None,
        "shaping": {
            "clip": shaping.clip,
            "overlong_buffer": shaping.overlong_buffer,
            "overlong_penalty": shaping.overlong_penalty,
            "max_response_length": a.max_response_length,
            "normalize": shaping.normalize,
            "mask_truncated": shaping.truncated == "Mask",
        },
    }


def sampling(spec: RLHFJobSpec) -> dict[str, Any]:
    """The rollout engines' sampling settings for one step's chunks."""
    return {
        "n": spec.algorithm.samples_per_prompt,
        "temperature": spec.rollout.temperature,
        "top_p": spec.rollout.top_p,
        "max_tokens": spec.algorithm.max_response_length,
        "max_prompt_tokens": spec.algorithm.max_prompt_length,
    }


def eval_sampling(spec: RLHFJobSpec) -> dict[str, Any]:
    """The rollout engines' sampling settings for the evaluation split (spec.evaluation.sampling; its
    defaults when data.eval is set without spec.evaluation): temperature 0 is greedy."""
    plan = spec.evaluation_plan()
    if plan is None:
        raise ValueError("no evaluation split (data.eval) to sample")
    s = plan.sampling
    return {
        "n": s.samples_per_prompt,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "max_tokens": s.max_tokens or spec.algorithm.max_response_length,
        "max_prompt_tokens": spec.algorithm.max_prompt_length,
    }


def engine_options(spec: RLHFJobSpec, info: DeviceInfo, threads: int) -> dict[str, Any]:
    """What every rollout engine (a vLLM `LLM` in a Ray actor) is started with."""
    return {
        "model_path": spec.model.actor,
        "device": info.kind,
        "seed": spec.algorithm.seed,
        "chat_template": spec.data.apply_chat_template,
        "max_model_len": spec.algorithm.max_prompt_length + spec.algorithm.max_response_length + 8,
        "tensor_parallel_size": spec.rollout.tensor_parallel_size,
        "gpu_memory_utilization": spec.rollout.gpu_memory_utilization,
        "enable_sleep": spec.rollout.enable_sleep,
        "enforce_eager": spec.rollout.enforce_eager,  # None: the engine decides by device (engine.enforce_eager)
        "enable_prefix_caching": spec.rollout.enable_prefix_caching,
        "threads": threads,
        "dtype": engine_dtype(spec, info),
    }


def engine_dtype(spec: RLHFJobSpec, info: DeviceInfo) -> str:
    """rollout.dtype with `auto` decided: bfloat16 on GPU when the trainer trains in bf16, float32 on the CPU
    stand-in, else vLLM's own `auto` (the model's). The weight sync casts to it before sending."""
    if spec.rollout.dtype != "auto":
        return spec.rollout.dtype
    if info.is_cpu:
        return "float32"
    return "bfloat16" if spec.trainer.bf16 else "auto"


def agent_options(spec: RLHFJobSpec) -> dict[str, Any] | None:
    """What the agent runner (agents.runner.AgentRunner) is started with; None without rollout.agent."""
    agent = spec.rollout.agent
    if agent is None:
        return None
    return {
        "function": agent.function,
        "max_turns": agent.max_turns,
        "max_tokens": agent.max_tokens,
        "max_episodes_per_engine": agent.max_episodes_per_engine,
        "tool_workers": agent.tool.workers,
        "tool_timeout_seconds": agent.tool.timeout_seconds,
        "tokenizer_path": spec.model.actor,  # the engines' tokenizer: the episodes' token ids are theirs
        "chat_template": spec.data.apply_chat_template,
        "input_key": spec.data.input_key,
        "label_key": spec.data.label_key,
        "seed": spec.algorithm.seed,
    }
