"""The RLHFJob resource as one typed model: the single source of truth for the CRD, `rlhf validate`,
the operator and the trainer. Imports only pydantic, the standard library and `k8s_schemas` (Kubernetes'
core/v1 schemas, stdlib only): no kopf, no Kubernetes client, no torch.
Cross-field rules live in `rules.py`; the CRD is generated from this file by `crd.py`.
"""

from __future__ import annotations

import math
import re
from datetime import datetime
from typing import Annotated, Any, Final, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationInfo, field_validator
from pydantic.alias_generators import to_camel

from rlhf_api import k8s_schemas
from rlhf_api.model_source import MODEL_SOURCE_HELP, MODEL_SOURCE_MAX_LENGTH, MODEL_SOURCE_PATTERN

GROUP: Final = "rlhf.dev"
VERSION: Final = "v1alpha1"
API_VERSION: Final = "rlhf.dev/v1alpha1"
KIND: Final = "RLHFJob"
PLURAL: Final = "rlhfjobs"
SINGULAR: Final = "rlhfjob"
SHORT_NAME: Final = "rlhf"
CRD_NAME: Final = "rlhfjobs.rlhf.dev"
# Longest autoscaling window; also the bound of status.rollout.generationShareHistory, which holds it.
MAX_WINDOW_STEPS: Final = 50

AdvantageEstimator = Literal["gae", "grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"]
# Estimators whose baseline is the other samples of the prompt's group (they need samplesPerPrompt >= 2).
GROUP_ESTIMATORS: Final = ("grpo", "rloo", "reinforce_pp_baseline")
KLEstimator = Literal["k1", "k2", "k3"]
RewardType = Literal["function", "model", "http"]
WeightSyncBackend = Literal["auto", "nccl", "gloo", "cuda_ipc", "shm"]
JobPhase = Literal[
    "Pending",
    "Queued",
    "Provisioning",
    "Running",
    "Stalled",
    "Restarting",
    "Succeeded",
    "Failed",
    "Suspended",
]
# The phases in order, read from the Literal: one list to extend.
JOB_PHASES: tuple[JobPhase, ...] = get_args(JobPhase)
TERMINAL_JOB_PHASES: frozenset[JobPhase] = frozenset({"Succeeded", "Failed"})
Role = Literal["actor", "critic", "reference", "reward"]

# A Kubernetes resource.Quantity written as in a Pod spec: an integer or a string such as "500m" or "16Gi".
QUANTITY_PATTERN = r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
Quantity = int | Annotated[str, StringConstraints(pattern=QUANTITY_PATTERN)]
KubeObject = dict[str, Any]


class _Spec(BaseModel):
    """Base of every spec model: camelCase on the wire, unknown fields rejected, no type coercion.

    Strict mode matches the API server, which rejects "4" for an integer and 1 for a string.
    """

    model_config = ConfigDict(
        alias_generator=to_camel,
        validate_by_name=True,
        validate_by_alias=True,
        serialize_by_alias=True,
        extra="forbid",
        frozen=True,
        strict=True,
    )


class _Status(BaseModel):
    """Base of the status models: camelCase on the wire; not strict, because timestamps arrive as strings."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        validate_by_name=True,
        validate_by_alias=True,
        serialize_by_alias=True,
        extra="forbid",
    )


# --------------------------------------------------------------------------------------------- model


class RewardSpec(_Spec):
    """How a sample is scored. Exactly the field that matches `type` is set: `function`, `model` or `url`."""

    type: RewardType = Field(
        description="Kind of reward: `function` (a Python function run by the trainer), `model` (a reward "
        "model in HF format, scored on the reward ranks) or `http` (a remote endpoint called per sample)."
    )
    function: str | None = Field(
        default=None,
        pattern=r"^[^:\s]+:[A-Za-z_][A-Za-z0-9_]*$",
        description="Python reward function as `module.path:function` (importable in the trainer image) or "
        "`path/to/file.py:function`. Called as fn(prompts, responses[, labels], **columns) -> list of floats; "
        "the dataset's other columns arrive as keyword arguments it names (docs/data.md). "
        "Set only when type is function.",
    )
    model: str | None = Field(
        default=None,
        min_length=1,
        max_length=MODEL_SOURCE_MAX_LENGTH,
        pattern=MODEL_SOURCE_PATTERN,
        description=f"Reward model: {MODEL_SOURCE_HELP}. Set only when type is model.",
    )
    url: str | None = Field(
        default=None,
        pattern=r"^https?://\S+$",
        description="Remote reward endpoint (http or https); receives JSON {prompts, responses, labels, "
        "columns} (columns: the dataset's other columns, one list each; absent when there are none) and "
        "returns {rewards: [...]}. Set only when type is http.",
    )
    timeout_seconds: float = Field(
        default=30.0,
        gt=0,
        description="Time limit for scoring one batch of samples; a timeout is a reward error.",
    )
    concurrency: int = Field(
        default=16, ge=1, description="Reward calls in flight at once (rewards are computed asynchronously)."
    )
    on_error: Literal["skipSample", "failStep"] = Field(
        default="failStep",
        description="What a reward error does: `failStep` fails the step (and the job restarts within "
        "runPolicy.backoffLimit), `skipSample` drops the sample. Either way it is counted in "
        "rlhf_reward_errors_total; a failed reward is never silently scored.",
    )


class ModelSpec(_Spec):
    """The models of the run: each an HF-format directory on a volume mounted in the pods, a Hub repository
    (`hf://`) or an S3 prefix (`s3://`), fetched into the model cache before the trainer starts."""

    actor: str = Field(
        min_length=1,
        max_length=MODEL_SOURCE_MAX_LENGTH,
        pattern=MODEL_SOURCE_PATTERN,
        description=f"Policy model being trained: {MODEL_SOURCE_HELP}.",
    )
    critic: str | None = Field(
        default=None,
        min_length=1,
        max_length=MODEL_SOURCE_MAX_LENGTH,
        pattern=MODEL_SOURCE_PATTERN,
        description=f"Value model (usually initialised from a reward model): {MODEL_SOURCE_HELP}. Required by "
        "the gae estimator; leave it unset for the critic-free estimators (grpo, rloo, reinforce_pp, "
        "reinforce_pp_baseline).",
    )
    reference: str | None = Field(
        default=None,
        min_length=1,
        max_length=MODEL_SOURCE_MAX_LENGTH,
        pattern=MODEL_SOURCE_PATTERN,
        description=f"Frozen reference policy for the KL penalty: {MODEL_SOURCE_HELP}; defaults to the "
        "initial actor.",
    )
    reward: RewardSpec = Field(description="How samples are scored.")

    @property
    def reference_path(self) -> str:
        """The reference model actually loaded: `reference`, or the actor's initial weights."""
        return self.reference or self.actor


class AsyncSpec(_Spec):
    """Asynchronous (one-step off-policy) RL: the engines generate step n+1 while the actor trains on step n.

    Each sample records the weight version that generated it; a sample more than `maxStaleness` optimizer
    steps older than the policy it would train is never trained on. The loss corrects for the lag with the
    engine's behaviour log-probs (`correction`)."""

    enabled: bool = Field(
        default=False,
        description="Overlap generation with training: the rollout engines generate the next step's batch "
        "(with the weights of the last sync) while the actor trains on this one. Needs engines on their own "
        "devices (not trainer.colocateAll) that stay awake (not rollout.enableSleep).",
    )
    max_staleness: int = Field(
        default=1,
        ge=1,
        le=1,
        description="How many optimizer steps older than the trained policy a sample's generating weights may "
        "be: 1, the one batch the pipeline keeps in flight (a larger bound would promise batches in flight "
        "that the trainer does not keep). An older batch (one kept across a lost weight sync) is handled by "
        "staleSamples.",
    )
    stale_samples: Literal["Regenerate", "Drop"] = Field(
        default="Regenerate",
        description="What happens to a batch older than maxStaleness: `Regenerate` it with the current "
        "weights before training (costs a generation on the critical path), or `Drop` it and train on the "
        "next one (costs its data). Either is counted in rlhf_stale_samples_total.",
    )


class RolloutCorrectionSpec(_Spec):
    """Importance weights for the gap between the engine that sampled a token and the trainer that scores it.

    The weight of a sampled token is pi_prox / pi_behav: the trainer's probability before this update over
    the engine's (vLLM's kernels, and in async mode weights one step older). Synchronous runs have the
    kernels' gap only; it is corrected too, as TRL does by default."""

    enabled: bool = Field(
        default=True,
        description="Weight each token's policy loss by pi_prox / pi_behav (bounded as below); off: the loss "
        "assumes the engine sampled from the trainer's distribution exactly.",
    )
    level: Literal["token", "sequence"] = Field(
        default="token",
        description="`token`: one weight per token; `sequence`: the product of the sequence's token weights "
        "(needs whole sequences on a rank: trainer.sequenceParallelSize 1).",
    )
    mode: Literal["truncate", "mask"] = Field(
        default="truncate",
        description="`truncate`: clamp the weight into [lowerBound, upperBound] (truncated importance "
        "sampling); `mask`: drop the tokens (or sequences) whose weight is outside it (masked importance "
        "sampling; AReaL's decoupled PPO).",
    )
    lower_bound: float = Field(
        default=0.0, ge=0, description="Lowest weight kept (truncate: raised to it); 0: no lower bound."
    )
    upper_bound: float = Field(
        default=2.0, gt=0, description="Highest weight kept (truncate: lowered to it)."
    )


class RewardShapingSpec(_Spec):
    """What happens to a sample's score before advantages are computed, in this order: clip, overlong
    penalty, running normalisation."""

    clip: float | None = Field(
        default=None, gt=0, description="Clamp every score into [-clip, clip]; unset: no clipping."
    )
    overlong_buffer: int | None = Field(
        default=None,
        ge=1,
        description="DAPO's soft overlong punishment: a response longer than maxResponseLength - "
        "overlongBuffer tokens loses up to overlongPenalty, linearly, reaching it at maxResponseLength. "
        "Unset: off. Must be below algorithm.maxResponseLength.",
    )
    overlong_penalty: float = Field(
        default=1.0,
        gt=0,
        description="The score a response of maxResponseLength tokens loses (overlongBuffer).",
    )
    normalize: bool = Field(
        default=False,
        description="Normalise scores by the running mean and standard deviation of every score of the run "
        "(checkpointed, so a resumed run goes on with the same statistics).",
    )
    truncated: Literal["Train", "Mask"] = Field(
        default="Train",
        description="Responses cut at maxResponseLength (no end of sequence): `Train` them like finished "
        "ones, or `Mask` them out of the loss (DAPO's overlong filtering; they still count in their group's "
        "baseline).",
    )


class DynamicSamplingSpec(_Spec):
    """DAPO's dynamic sampling: never train a group whose rewards are all equal (its group-relative
    advantage is zero for every sample)."""

    enabled: bool = Field(
        default=False,
        description="Drop groups whose rewards are all equal and generate further prompts until the step has "
        "rolloutBatchSize groups that are not (group estimators: grpo, rloo, reinforce_pp_baseline).",
    )
    max_extra_rounds: int = Field(
        default=3,
        ge=1,
        le=16,
        description="Extra generation rounds a step may take to fill its batch; after them, the step trains "
        "the informative groups it has plus as many equal-reward ones as fill it (counted in "
        'rlhf_dynamic_sampling_groups_total{outcome="short"}).',
    )


class AlgorithmSpec(_Spec):
    """The PPO-family algorithm and its batch geometry. One step = one rollout batch, then training on it."""

    advantage_estimator: AdvantageEstimator = Field(
        default="grpo",
        description="Advantage estimator: `gae` (PPO with a critic; needs model.critic), `grpo` (group-relative "
        "baseline over samplesPerPrompt samples), `rloo` (leave-one-out group baseline), `reinforce_pp` "
        "(REINFORCE++: returns of the score and the per-token KL, whitened over the batch) or "
        "`reinforce_pp_baseline` (the same with the group mean subtracted from the score).",
    )
    grpo_std_normalization: bool = Field(
        default=True,
        description="grpo divides each score's distance to its group mean by the group's std; false is "
        "Dr. GRPO's estimator (pair it with lossAggregation seq-mean-token-sum-norm).",
    )
    policy_loss: Literal["ppo", "gspo"] = Field(
        default="ppo",
        description="`ppo`: the clipped surrogate per token; `gspo`: GSPO's sequence-level ratio (the "
        "geometric mean of the token ratios) clipped per sequence (needs trainer.sequenceParallelSize 1; GSPO "
        "uses clip ranges near 3e-4 / 4e-4).",
    )
    kl_coef: float = Field(
        default=0.01,
        ge=0,
        description="KL penalty coefficient against the reference model; 0 disables the reference. With "
        "klTarget set, the adaptive controller's starting value.",
    )
    kl_estimator_reward: KLEstimator = Field(
        default="k1",
        description="KL estimator in the reward (gae, reinforce_pp, reinforce_pp_baseline): k1 = log(pi/ref), "
        "k2 = log(pi/ref)^2 / 2, k3 = ref/pi - 1 - log(ref/pi).",
    )
    kl_estimator_loss: KLEstimator = Field(
        default="k3",
        description="KL estimator in the loss (grpo, rloo): k1, k2 or k3 (see klEstimatorReward).",
    )
    kl_target: float | None = Field(
        default=None,
        gt=0,
        description="Adaptive KL (Ziegler et al. 2019): after each step the coefficient moves toward keeping "
        "the measured KL at klTarget (by at most 20 % x samples / klHorizon); unset: klCoef stays fixed.",
    )
    kl_horizon: int = Field(
        default=10000, ge=1, description="The adaptive KL controller's horizon, in samples (see klTarget)."
    )
    clip_range: float = Field(default=0.2, gt=0, le=1, description="PPO policy ratio clip range (epsilon).")
    clip_range_low: float | None = Field(
        default=None, gt=0, lt=1, description="The ratio's lower clip, 1 - clipRangeLow; unset: clipRange."
    )
    clip_range_high: float | None = Field(
        default=None,
        gt=0,
        description="The ratio's upper clip, 1 + clipRangeHigh; unset: clipRange. Above clipRangeLow it is "
        "DAPO's clip-higher (0.28 with 0.2 in the paper).",
    )
    dual_clip: float | None = Field(
        default=None,
        gt=1,
        description="Dual-clip PPO's bound c: a negative advantage's loss is at most c x |A| however large the "
        "ratio; unset: off (verl uses 3).",
    )
    entropy_coef: float = Field(
        default=0.0,
        ge=0,
        description="Entropy bonus: the loss minus entropyCoef x the policy's mean token entropy (always "
        "reported as the step's `entropy`).",
    )
    value_clip_range: float = Field(default=0.2, gt=0, description="Value function clip range (gae only).")
    gamma: float = Field(default=1.0, ge=0, le=1, description="Discount factor (gae only).")
    lam: float = Field(default=0.95, ge=0, le=1, alias="lambda", description="GAE lambda (gae only).")
    samples_per_prompt: int = Field(
        default=4,
        ge=1,
        description="Responses sampled per prompt; grpo, rloo and reinforce_pp_baseline need at least 2 (a "
        "group).",
    )
    rollout_batch_size: int = Field(default=64, ge=1, description="Prompts per step.")
    train_micro_batch_size: int = Field(
        default=8,
        ge=1,
        description="Samples per forward/backward pass on one training rank; must divide the samples per "
        "step (rolloutBatchSize x samplesPerPrompt).",
    )
    rollout_micro_batch_size: int = Field(
        default=16,
        ge=1,
        description="Samples per experience micro-batch (reference, critic values, old log-probs), so peak "
        "memory does not grow with the rollout batch; must divide the samples per step.",
    )
    max_prompt_length: int = Field(
        default=1024, ge=1, description="Prompts are truncated to this many tokens."
    )
    max_response_length: int = Field(default=1024, ge=1, description="Maximum generated tokens per response.")
    epochs: int = Field(default=1, ge=1, description="PPO epochs over each rollout batch.")
    mini_batches_per_epoch: int = Field(
        default=1,
        ge=1,
        description="Optimizer steps per epoch: each rank's share of the rollout is split into this many "
        "mini-batches, each one optimizer step (verl's ppo_mini_batch_size, OpenRLHF's train_batch_size). "
        "With 1 mini-batch and 1 epoch the PPO ratio is always 1 and the clip never acts. Must divide the "
        "samples of each actor data-parallel group.",
    )
    loss_aggregation: Literal[
        "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
    ] = Field(
        default="token-mean",
        description="How per-token losses become the step's loss (verl's names), over the global counts of "
        "a mini-batch on every rank: `token-mean` (sum over valid tokens / their number), "
        "`seq-mean-token-mean` (mean over sequences of each one's token mean), `seq-mean-token-sum` "
        "(mean over sequences of each one's token sum) or `seq-mean-token-sum-norm` (that over "
        "maxResponseLength: Dr. GRPO's constant normaliser).",
    )
    total_steps: int = Field(
        default=1000, ge=1, description="Steps to train; the job succeeds after the last one."
    )
    actor_learning_rate: float = Field(default=1e-6, gt=0, description="Actor (policy) learning rate.")
    critic_learning_rate: float = Field(default=9e-6, gt=0, description="Critic learning rate (gae only).")
    lr_warmup_steps: int = Field(default=0, ge=0, description="Linear learning-rate warmup, in steps.")
    lr_scheduler: Literal["constant", "cosine", "linear"] = Field(
        default="constant", description="Learning-rate schedule after warmup."
    )
    seed: int = Field(
        default=42, ge=0, description="Random seed for sampling, data order and initialisation."
    )
    async_: AsyncSpec = Field(
        default_factory=AsyncSpec,
        alias="async",
        description="Asynchronous RL: generate step n+1 while step n trains, with bounded staleness and "
        "an off-policy correction (off by default).",
    )
    rollout_correction: RolloutCorrectionSpec = Field(
        default_factory=RolloutCorrectionSpec,
        description="Importance weights between the engine's log-probs and the trainer's (both modes; in "
        "async mode they also correct for the weights one step older).",
    )
    reward_shaping: RewardShapingSpec = Field(
        default_factory=RewardShapingSpec,
        description="Score clipping, DAPO's overlong penalty, running normalisation, truncated responses.",
    )
    dynamic_sampling: DynamicSamplingSpec = Field(
        default_factory=DynamicSamplingSpec,
        description="DAPO's dynamic sampling: refill the batch past groups whose rewards are all equal.",
    )

    @property
    def samples_per_step(self) -> int:
        """Samples generated and trained on per step."""
        return self.rollout_batch_size * self.samples_per_prompt

    @property
    def uses_critic(self) -> bool:
        """Whether this estimator trains a critic (only gae does)."""
        return self.advantage_estimator == "gae"

    @property
    def uses_reference(self) -> bool:
        """Whether the reference model is needed: only for a KL penalty."""
        return self.kl_coef > 0

    @property
    def kl_in_reward(self) -> bool:
        """Whether the KL penalty is part of the reward (gae, reinforce_pp*); grpo and rloo put it in the loss."""
        return self.uses_reference and self.advantage_estimator not in ("grpo", "rloo")

    @property
    def uses_groups(self) -> bool:
        """Whether the estimator's baseline is the prompt's group (it needs samplesPerPrompt >= 2)."""
        return self.advantage_estimator in GROUP_ESTIMATORS

    @property
    def old_logprobs_redundant(self) -> bool:
        """The old log-probs forward can be skipped: one epoch of one mini-batch trains on-policy (the
        ratio is 1 by construction) and no KL in the reward needs them before training. The training
        pass's own detached log-probs are used instead, as TRL does."""
        return self.epochs == 1 and self.mini_batches_per_epoch == 1 and not self.kl_in_reward


class EvalDataSpec(_Spec):
    """The evaluation split: prompts generated and scored on the rollout engines every evaluation.everySteps
    steps and at the end, reported apart from training (eval_reward_mean)."""

    prompts: str = Field(
        min_length=1,
        description="Evaluation prompts: a .jsonl or .parquet file on a mounted volume or an s3://bucket/key "
        "object (needs spec.storage.s3), in the form of "
        "data.prompts (the same inputKey and labelKey; every other column reaches the reward function, and "
        "`data_source`, when present, splits eval_reward_mean by source). Streamed in file order, never "
        "shuffled (docs/data.md).",
    )
    max_prompts: int | None = Field(
        default=None,
        ge=1,
        description="Evaluate only the first maxPrompts rows of the file. Unset: every row.",
    )


class DataSpec(_Spec):
    """The prompt dataset."""

    prompts: str = Field(
        min_length=1,
        description="Prompt dataset: a .jsonl file (one JSON object per line) or a .parquet file, chosen by "
        "its extension, on a mounted volume or as an s3://bucket/key object (needs spec.storage.s3; "
        "docs/data.md). The driver streams it (an index, not the rows; ranged reads from the object store).",
    )
    input_key: str = Field(
        default="prompt",
        min_length=1,
        description="Key (column) of the prompt in each row: a string, or a list of chat messages "
        '({"role": "system"|"user"|"assistant", "content": string}) rendered by the actor tokenizer\'s '
        "chat template. Every other column reaches a Python reward function as keyword arguments "
        "(docs/data.md).",
    )
    label_key: str | None = Field(
        default=None,
        min_length=1,
        description="Key of a reference answer passed to the reward function as `labels` (optional).",
    )
    apply_chat_template: bool = Field(
        default=False,
        description="Wrap each string prompt as one user turn in the actor tokenizer's chat template "
        "before generation. Chat-message prompts always go through the template.",
    )
    eval: EvalDataSpec | None = Field(
        default=None,
        description="The evaluation split, scored during training (spec.evaluation says when and how it is "
        "sampled) and never trained on. Unset: no evaluation.",
    )


class Placement(_Spec):
    """Where one model's ranks run: `nodes` pods with `gpusPerNode` GPUs each (one rank per GPU).

    On CPU a "GPU" is one rank, that is one process.
    """

    nodes: int = Field(default=1, ge=1, description="Pods (nodes) for this model.")
    gpus_per_node: int = Field(
        default=1,
        ge=1,
        description="GPUs per pod, one rank each. On CPU-only clusters a GPU is one rank (process).",
    )

    @property
    def ranks(self) -> int:
        """Total ranks (processes) of this model: nodes x gpusPerNode."""
        return self.nodes * self.gpus_per_node


class TrainerSpec(_Spec):
    """Placement and DeepSpeed settings of the trained and scoring models."""

    actor: Placement = Field(
        default_factory=Placement, description="Actor placement (DeepSpeed data-parallel ranks)."
    )
    critic: Placement | None = Field(
        default=None,
        description="Critic placement; defaults to the actor's. Used only when the estimator is gae.",
    )
    reference: Placement | None = Field(
        default=None,
        description="Reference model placement; defaults to the actor's. Used only when klCoef > 0.",
    )
    reward: Placement | None = Field(
        default=None,
        description="Reward model placement; defaults to the critic's. Used only when reward.type is model.",
    )
    colocate_actor_ref: bool | None = Field(
        default=None,
        description="Run the reference model on the actor's GPUs (default false; implied by colocateAll). "
        "The reference placement, if set, must equal the actor's.",
    )
    colocate_critic_reward: bool | None = Field(
        default=None,
        description="Run the reward model on the critic's GPUs (default false; implied by colocateAll). "
        "The reward placement, if set, must equal the critic's.",
    )
    colocate_all: bool = Field(
        default=False,
        description="Run every model and the vLLM rollout engines on the actor's GPUs, taking turns (hybrid "
        "engine). Needs actor ranks = rollout.engines x rollout.tensorParallelSize; excludes autoscaling.",
    )
    zero_stage: int = Field(default=3, ge=0, le=3, description="DeepSpeed ZeRO stage (0-3).")
    offload: bool = Field(
        default=False, description="Offload ZeRO optimizer state (and parameters at stage 3) to CPU."
    )
    bf16: bool = Field(
        default=True, description="Train in bfloat16 mixed precision (set false on CPU-only clusters)."
    )
    gradient_checkpointing: bool = Field(
        default=False, description="Recompute activations in the backward pass to save memory."
    )
    packing: bool = Field(
        default=True,
        description=(
            "Pack each training and scoring micro-batch's samples into one row without padding (position ids "
            "restarted per sample), cut by tokens into as many micro-batches as trainMicroBatchSize gives. "
            "Off, said in the trainer log, for a group with sequenceParallelSize > 1 and for a model whose "
            "attention does not keep packed samples apart."
        ),
    )
    sequence_parallel_size: int = Field(
        default=1,
        ge=1,
        description=(
            "Ranks that split one sequence (Ulysses: all-to-all over attention heads); must divide the "
            "actor's ranks, and the attention and key-value head counts of every model it splits. Heads "
            "are checked by `rlhf validate` and by the trainer at start, not at admission (the model is a "
            "path the API server cannot read). A critic or reference group whose ranks it does not divide "
            "runs whole sequences."
        ),
    )

    def sequence_parallel_for(self, ranks: int) -> int:
        """The SP size a model group of `ranks` ranks uses: sequenceParallelSize when it divides them,
        else 1 (whole sequences, e.g. a one-rank critic)."""
        return self.sequence_parallel_size if ranks % self.sequence_parallel_size == 0 else 1

    def data_parallel_size(self, ranks: int) -> int:
        """Data-parallel groups of a model group of `ranks` ranks: each sequence-parallel block is one
        group (it reads one shard of the rollout batch)."""
        return ranks // self.sequence_parallel_for(ranks)

    @property
    def actor_ref_colocated(self) -> bool:
        """Whether the reference model shares the actor's GPUs."""
        return self.colocate_all or bool(self.colocate_actor_ref)

    @property
    def critic_reward_colocated(self) -> bool:
        """Whether the reward model shares the critic's GPUs."""
        return self.colocate_all or bool(self.colocate_critic_reward)

    def placement(self, role: Role) -> Placement:
        """The placement of `role` after defaults: critic and reference default to the actor's, reward to
        the critic's."""
        if role == "actor":
            return self.actor
        if role == "critic":
            return self.critic or self.actor
        if role == "reference":
            return self.reference or self.actor
        return self.reward or self.placement("critic")


class AutoscalingSpec(_Spec):
    """The operator's built-in engine autoscaler, driven by the generation share of the step time."""

    enabled: bool = Field(default=False, description="Let the operator change rollout.engines between steps.")
    min_engines: int = Field(default=1, ge=1, description="Fewest engines the autoscaler keeps.")
    max_engines: int = Field(default=8, ge=1, description="Most engines the autoscaler adds.")
    target_generation_share: float = Field(
        default=0.5,
        gt=0,
        lt=1,
        description="Target fraction of the step spent in generation; above target + hysteresis engines are "
        "added, below target - hysteresis they are removed.",
    )
    hysteresis: float = Field(
        default=0.1, ge=0, lt=1, description="Dead band around the target; must be smaller than the target."
    )
    window_steps: int = Field(
        default=3,
        ge=1,
        le=MAX_WINDOW_STEPS,
        description="Consecutive steps the share must stay out of band before the autoscaler acts, all "
        "started after the last engine-count change.",
    )
    cooldown_seconds: int = Field(
        default=300, ge=0, description="Minimum time between two scaling decisions."
    )


class EvalSamplingSpec(_Spec):
    """How the engines sample the evaluation split (independent of the training rollout's sampling)."""

    temperature: float = Field(
        default=0.0,
        ge=0,
        description="Sampling temperature; 0 (the default) is greedy decoding.",
    )
    top_p: float = Field(default=1.0, gt=0, le=1, description="Nucleus sampling probability mass.")
    max_tokens: int | None = Field(
        default=None,
        ge=1,
        description="Most tokens generated per response; unset: algorithm.maxResponseLength, which bounds it "
        "(the engines' context is sized from it).",
    )
    # Not `n` (vLLM's name): YAML 1.1, which the API server's decoder speaks, reads a bare `n:` key as the
    # boolean false, so a field named `n` can be neither written by users nor named in a rule.
    samples_per_prompt: int = Field(
        default=1,
        ge=1,
        description="Responses per evaluation prompt; eval_reward_mean averages over all of them.",
    )


class EvaluationSpec(_Spec):
    """When the evaluation split (data.eval) is generated and scored: every everySteps steps and after the
    last step, on the rollout engines with the weights just trained. Its samples are never trained on and
    never counted in the training figures; its time is the step's `eval` phase."""

    every_steps: int | None = Field(
        default=None,
        ge=1,
        description="Evaluate after every step whose number is a multiple of everySteps. Unset: only at the "
        "end (atEnd).",
    )
    at_end: bool = Field(
        default=True,
        description="Evaluate after the last step (algorithm.totalSteps) too, when everySteps does not "
        "already land on it.",
    )
    sampling: EvalSamplingSpec = Field(
        default_factory=EvalSamplingSpec,
        description="The evaluation's sampling settings; greedy with one response per prompt by default.",
    )

    def due(self, step: int, total_steps: int) -> bool:
        """Whether step `step` (counting from 1) of a run of `total_steps` ends with an evaluation."""
        every = self.every_steps is not None and step % self.every_steps == 0
        return every or (self.at_end and step == total_steps)


class AgentToolSpec(_Spec):
    """The pool an agent's tool calls run in, and each call's time limit."""

    timeout_seconds: float = Field(
        default=10.0,
        gt=0,
        description="Time limit of one tool call, counted from when a worker starts it; a call past it ends "
        "its episode (end reason tool_timeout, counted in rlhf_agent_tool_errors and rlhf_agent_episodes_total), never the step.",
    )
    workers: int = Field(
        default=4,
        ge=1,
        description="Tool calls run at once (a thread pool shared by the step's episodes); a call waits for "
        "a free worker before its timeout starts. A worker holding a call past its timeout stays held until "
        "the call returns; when every worker is held so, new calls fail at once as tool_timeout.",
    )


class AgentSpec(_Spec):
    """Agentic (multi-turn, tool-calling) rollouts: every sample is an episode of a Python agent function
    that generates, calls tools and generates again, token in and token out (docs/agents.md)."""

    function: str = Field(
        pattern=r"^[^:\s]+:[A-Za-z_][A-Za-z0-9_]*$",
        description="The agent function as `module.path:function` (importable in the trainer image) or "
        "`path/to/file.py:function`, like model.reward.function. An `async def` called with one Episode (the "
        "prompt row, its token ids, an engine client, the tool pool, the limits) that returns the "
        "trajectory: token ids with a loss mask (model tokens 1, tool and environment tokens 0) and, "
        "optionally, the reward (unset: model.reward scores the decoded trajectory).",
    )
    max_turns: int = Field(default=4, ge=1, description="Most model turns (generation calls) of one episode.")
    max_tokens: int = Field(
        default=1024,
        ge=1,
        description="The episode's token budget after the prompt, model and tool tokens together; at most "
        "algorithm.maxResponseLength (the engines' and the trainer's context is sized from it).",
    )
    max_episodes_per_engine: int = Field(
        default=16,
        ge=1,
        description="Episodes running at once on one engine. Episodes start one at a time on the engine "
        "with the fewest in flight, not in static chunks.",
    )
    tool: AgentToolSpec = Field(
        default_factory=AgentToolSpec, description="The tool pool and the per-call timeout."
    )


class RolloutSpec(_Spec):
    """The vLLM rollout engines. `engines` is the scale subresource's replica count."""

    engines: int = Field(
        default=1,
        ge=1,
        description="vLLM engines (scale subresource). `kubectl scale` outside the autoscaling range is "
        "accepted and clamped by the operator.",
    )
    tensor_parallel_size: int = Field(
        default=1, ge=1, description="GPUs per engine (vLLM tensor parallelism)."
    )
    gpus_per_worker: int | None = Field(
        default=None,
        ge=1,
        description="GPUs of one rollout worker pod; defaults to tensorParallelSize. A worker runs "
        "gpusPerWorker / tensorParallelSize engines, so tensorParallelSize must divide it.",
    )
    gpu_memory_utilization: float = Field(
        default=0.9, gt=0, le=1, description="Fraction of GPU memory vLLM may use (weights, KV cache)."
    )
    enable_sleep: bool = Field(
        default=False, description="Put engines to sleep (free KV cache and weights) while the trainer runs."
    )
    enforce_eager: bool | None = Field(
        default=None,
        description="Run vLLM eagerly: no torch.compile and no CUDA graphs. Unset: compiled with CUDA "
        "graphs on GPU (faster decoding, after a longer engine start), eager on the CPU backend. true "
        "saves the start time and the graphs' memory; false on CPU compiles with inductor at start.",
    )
    enable_prefix_caching: bool = Field(
        default=True,
        description="vLLM's prefix caching: a prompt's KV, computed once, serves its other samples "
        "(algorithm.samplesPerPrompt) and repeated prompts. The cache is dropped at every weight sync, so "
        "no sample sees KV of older weights.",
    )
    temperature: float = Field(
        default=1.0,
        gt=0,
        description="Sampling temperature, above 0: the training log-probs are taken at it (logits / T).",
    )
    top_p: float = Field(default=1.0, gt=0, le=1, description="Nucleus sampling probability mass.")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        default="auto",
        description="The engines' weight dtype. `auto`: bfloat16 on GPU when trainer.bf16, float32 on the "
        "CPU stand-in. Weights are cast to it before the sync sends them (so a bfloat16 engine of a float32 "
        "trainer receives half the bytes).",
    )
    autoscaling: AutoscalingSpec = Field(
        default_factory=AutoscalingSpec, description="Built-in engine autoscaler."
    )
    agent: AgentSpec | None = Field(
        default=None,
        description="Agentic rollouts: each sample an episode of a multi-turn, tool-calling agent function "
        "(docs/agents.md). Unset: one model turn per sample, as without agents.",
    )

    @property
    def worker_gpus(self) -> int:
        """GPUs of one rollout worker pod (gpusPerWorker, or tensorParallelSize)."""
        return self.gpus_per_worker or self.tensor_parallel_size

    @property
    def engines_per_worker(self) -> int:
        """Engines one rollout worker pod runs."""
        return self.worker_gpus // self.tensor_parallel_size

    def replicas(self, engines: int | None = None) -> int:
        """Rollout worker pods needed for `engines` engines (default: spec engines), rounding up."""
        wanted = self.engines if engines is None else engines
        return math.ceil(wanted * self.tensor_parallel_size / self.worker_gpus)


class DeltaSyncSpec(_Spec):
    """Delta weight sync: per bucket, only the elements (in the engines' dtype) whose bits changed since
    the engines' copy, as positions and values or a bitmask and values, or the whole bucket when that is
    smaller. The engines keep a copy of every bucket; digests compare it with the trainer's."""

    enabled: bool = Field(
        default=False,
        description="Off by default: on this project's CPU measurements the comparison costs more time than "
        "the bytes it saves (docs/benchmarks.md, delta_sync.py); turn it on where the link is slower than "
        "memory (engines on other nodes over TCP).",
    )
    full_above: float = Field(
        default=0.5,
        gt=0,
        le=1,
        alias="fullAbove",
        description="A bucket whose delta would carry more than this share of its full bytes is sent whole "
        "(and, with `recheckEvery`, not compared again for a while).",
    )
    recheck_every: int = Field(
        default=8,
        ge=1,
        alias="recheckEvery",
        description="A bucket sent whole because too much changed is sent whole without comparing for this "
        "many syncs minus one, then compared again.",
    )
    choose: Literal["time", "bytes"] = Field(
        default="time",
        description="`time`: a bucket goes as a delta only when comparing and applying it is expected to "
        "take less time than sending it whole (priced from a 1/64 sample of the bucket and the link speed "
        "measured on whole buckets; a bucket priced whole is not priced again for recheckEvery syncs, then "
        "twice as many), so turning delta on never makes a sync much slower. `bytes`: whenever the delta is "
        "smaller (a link whose cost the trainer's clock does not see: shared, metered or congested).",
    )
    verify_every: int = Field(
        default=10,
        ge=1,
        alias="verifyEvery",
        description="Compare the engines' digests of every bucket with the trainer's on the first sync of "
        "each channel (start, resume, engines joining) and every this many syncs; a mismatch forces a full "
        "sync at once and is counted (rlhf_weight_sync_digest_mismatches_total).",
    )


class WeightSyncSpec(_Spec):
    """How updated actor weights reach the rollout engines after each step."""

    backend: WeightSyncBackend = Field(
        default="auto",
        description="Transport: `auto` (nccl on GPU, gloo on CPU, cuda_ipc when colocateAll), `nccl`, `gloo`, "
        "`cuda_ipc` (same GPU only: needs trainer.colocateAll) or `shm` (same node).",
    )
    bucket_size_mib: int = Field(
        default=256,
        ge=1,
        alias="bucketSizeMiB",
        description="Gathered ZeRO-3 partitions are sent in buckets of at most this many MiB.",
    )
    delta: DeltaSyncSpec = Field(
        default_factory=DeltaSyncSpec,
        description="Send only the elements that changed since the engines' copy.",
    )


class CheckpointSpec(_Spec):
    """Checkpoints (model, optimizer, scheduler, data position, step), written atomically."""

    path: str | None = Field(
        default=None,
        min_length=1,
        description="Directory for checkpoints on a volume shared by the trainer pods; unset disables "
        "checkpoints, and a restart then starts from step 0.",
    )
    interval_steps: int = Field(default=50, ge=1, description="Write a checkpoint every this many steps.")
    keep_last: int = Field(default=2, ge=1, description="Checkpoints kept; older ones are deleted.")
    export: Literal["onFinish", "everyCheckpoint", "never"] = Field(
        default="onFinish",
        description="Export the actor as a Hugging Face model directory (safetensors, config, tokenizer) "
        "to exportPath: when the run finishes, after every checkpoint, or never. Needs path.",
    )
    export_path: str | None = Field(
        default=None,
        min_length=1,
        description="Where the exported model goes (replaced at each export); default <path>/model.",
    )
    export_to: str | None = Field(
        default=None,
        pattern=r"^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]/\S+$",
        description="Also upload each export to this object-store prefix, s3://bucket/prefix (needs "
        "spec.storage.s3): every file first, then the marker object rlhf-export-complete.json (the files, "
        "their sizes and sha256) last; a prefix without the marker is not a model. Progress in "
        "status.export; a failed upload is retried, then reported there, and the local export is kept "
        "(docs/trainer.md).",
    )
    on_preemption: Literal["Save", "KeepLast"] = Field(
        default="Save",
        description="When the trainer is told to stop (Kueue preemption, suspension, a drained node): `Save` "
        "finishes the step in progress and writes a checkpoint if that fits in "
        "runPolicy.terminationGracePeriodSeconds, else keeps the last one; `KeepLast` stops at the next "
        "step boundary and keeps the last one. Needs path.",
    )
    resume: Literal["auto", "never", "force"] = Field(
        default="auto",
        description="`auto` resumes from the newest complete checkpoint in path if it is this job's, with "
        "the same model, algorithm and data settings (totalSteps may grow), and fails naming the "
        "difference otherwise; `never` starts fresh; `force` resumes from it whatever changed.",
    )

    def export_dir(self) -> str | None:
        """Where the actor is exported (None: no export: export is never, or there are no checkpoints)."""
        if self.export == "never" or not self.path:
            return None
        return self.export_path or f"{self.path.rstrip('/')}/model"


class MonitoringSpec(_Spec):
    """Trainer metrics and stall detection."""

    stall_timeout_seconds: int = Field(
        default=1800,
        ge=1,
        description="A step running longer than this is a stall; at least 2 x scrapeIntervalSeconds.",
    )
    startup_timeout_seconds: int | None = Field(
        default=None,
        ge=1,
        description="How long an attempt may run before its first step completes (start-up: loading the "
        "models, starting the engines, and that step) before that is a stall. Unset: stallTimeoutSeconds. "
        "Set it above stallTimeoutSeconds when start-up takes longer than a step (a large model).",
    )
    metrics_port: int = Field(
        default=9400, ge=1, le=65535, description="Port of the trainer's Prometheus /metrics."
    )
    scrape_interval_seconds: int = Field(
        default=15, ge=1, description="How often the operator reads the trainer's metrics."
    )
    on_stall: Literal["Alert", "Restart"] = Field(
        default="Restart",
        description="On a stall: `Alert` only sets the Stalled phase and an Event; `Restart` also restarts from "
        "the last checkpoint, within runPolicy.backoffLimit.",
    )
    stack_snapshot_timeout_seconds: int = Field(
        default=60,
        ge=0,
        le=600,
        description="On a stall, the operator first takes a snapshot of every process's Python stack (driver, "
        "ranks, engines, reward scorer; 5 s per process) and names who is stuck where in the Stalled "
        "condition, an Event and the ConfigMap <job>-stacks (`rlhf diagnose JOB`); onStall: Restart "
        "restarts once it is taken or this many seconds have passed. 0: no snapshot.",
    )

    def timeout_in_force(self, first_step_done: bool) -> int:
        """The stall timeout an attempt is held to: startupTimeoutSeconds until its first step completes
        (when set), stallTimeoutSeconds after. The trainer exports it, and the operator applies it."""
        if first_step_done or self.startup_timeout_seconds is None:
            return self.stall_timeout_seconds
        return self.startup_timeout_seconds


# Secret names as the API server spells them (a DNS subdomain); the operator injects the Secret's keys
# as env of the head pod, where the driver runs; never their values in the spec or the RayCluster.
SECRET_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$"


class MlflowTrackingSpec(_Spec):
    """An MLflow tracking server the driver logs the run to (docs/tracking.md)."""

    tracking_uri: str = Field(
        min_length=1,
        pattern=r"^https?://\S+$",
        description="The MLflow tracking server's URL (http or https), reachable from the head pod.",
    )
    experiment: str = Field(
        min_length=1, description="The experiment's name; created on first use when it does not exist."
    )
    run_name: str | None = Field(
        default=None, min_length=1, description="The run's name; unset: the RLHFJob's name."
    )
    credentials_secret: str | None = Field(
        default=None,
        pattern=SECRET_NAME_PATTERN,
        description="A Secret in the job's namespace with MLFLOW_TRACKING_USERNAME and "
        "MLFLOW_TRACKING_PASSWORD, or MLFLOW_TRACKING_TOKEN (each key optional); given to the head pod as "
        "env from the Secret, never copied.",
    )


class WandbTrackingSpec(_Spec):
    """A Weights & Biases run the driver logs to (docs/tracking.md)."""

    project: str = Field(min_length=1, description="The W&B project.")
    entity: str | None = Field(default=None, min_length=1, description="The W&B entity (user or team).")
    mode: Literal["online", "offline"] = Field(
        default="online",
        description="`online` logs to the W&B service (needs apiKeySecret); `offline` writes the run "
        "directory under WANDB_DIR (default: the driver's working directory) for a later `wandb sync`.",
    )
    api_key_secret: str | None = Field(
        default=None,
        pattern=SECRET_NAME_PATTERN,
        description="A Secret in the job's namespace with the key WANDB_API_KEY (and optionally "
        "WANDB_BASE_URL for a self-hosted server); given to the head pod as env from the Secret.",
    )


class TensorBoardTrackingSpec(_Spec):
    """TensorBoard event files the driver writes (docs/tracking.md)."""

    log_dir: str = Field(
        min_length=2,
        pattern=r"^/\S*$",
        description="An absolute directory on a volume mounted in the head pod (spec.pods.volumeMounts); "
        "the run writes under <logDir>/<job name>.",
    )


class TrackingSpec(_Spec):
    """Experiment tracking: any subset of MLflow, W&B and TensorBoard, fed from the step report that feeds
    Prometheus. A sink that is down never stops training: its calls are queued, retried and counted
    (rlhf_tracking_errors_total) and the TrackingHealthy condition names it."""

    mlflow: MlflowTrackingSpec | None = Field(default=None, description="Log the run to MLflow.")
    wandb: WandbTrackingSpec | None = Field(default=None, description="Log the run to Weights & Biases.")
    tensorboard: TensorBoardTrackingSpec | None = Field(
        default=None, description="Write TensorBoard event files."
    )
    samples_every_steps: int | None = Field(
        default=None,
        ge=1,
        description="Every this many steps, log a table of sample completions (prompt, completion, reward) "
        "from the step's rollout. Unset: no samples.",
    )
    samples_per_table: int = Field(
        default=8, ge=1, le=256, description="Rows of each samples table (the first samples of the step)."
    )

    def sinks(self) -> list[str]:
        """The configured sinks' names, in a fixed order."""
        return [n for n in ("mlflow", "wandb", "tensorboard") if getattr(self, n) is not None]


class RunPolicySpec(_Spec):
    """Lifecycle of the job."""

    suspend: bool = Field(
        default=False,
        description="Suspend the job: the trainer is stopped (checkpoint.onPreemption), its RayCluster "
        "suspended (deleted when Kueue manages it) and resumed from the last checkpoint.",
    )
    backoff_limit: int = Field(
        default=3,
        ge=0,
        description="Restarts from the last checkpoint before the job fails. Bad input the trainer finds at run time (it exits 2: a model path that does not exist, a reward function that does not import) fails the job at once, reason InvalidInput, with no restart.",
    )
    active_deadline_seconds: int | None = Field(
        default=None,
        ge=1,
        description="Fail the job if it is active longer than this, counted from its creation or its "
        "last unsuspension as for a Kubernetes Job, time spent provisioning included (unset: no limit).",
    )
    provisioning_timeout_seconds: int | None = Field(
        default=None,
        ge=1,
        description="Longest an attempt may take from its start (creation, unsuspension or restart) to "
        "its trainer running: pods unschedulable, images not pulled or a Ray head that never answers "
        "(unset: wait).",
    )
    on_provisioning_timeout: Literal["Fail", "Restart"] = Field(
        default="Fail",
        description="At provisioningTimeoutSeconds: `Fail` the job, or `Restart` it on a new RayCluster "
        "(counts against backoffLimit).",
    )
    ttl_seconds_after_finished: int | None = Field(
        default=None,
        ge=0,
        description="Delete the job this long after it succeeds or fails (unset: keep it).",
    )
    termination_grace_period_seconds: int = Field(
        default=30,
        ge=15,
        le=3600,
        description="Every pod's grace period, and the trainer's time to stop when told to (preemption, "
        "suspension): it saves a checkpoint at a step boundary only if it can finish within this, less "
        "10 s for the pods' own shutdown (checkpoint.onPreemption).",
    )


class SecuritySpec(_Spec):
    """Who may reach the job's Ray cluster (docs/security.md). Both are on by default; turning one off is an
    explicit choice the operator records with a Warning Event. Read when a RayCluster is created (a restart
    or a resume creates the next one with the values then in the spec)."""

    ray_authentication: Literal["Token", "Disabled"] = Field(
        default="Token",
        description="`Token`: the head and workers start with Ray's token authentication (RAY_AUTH_MODE=token) "
        "and a token of this job only, in a Secret the job owns; the operator's Jobs API calls carry it. "
        "`Disabled`: anyone who reaches the head's ports can run code as the trainer.",
    )
    network_policy: Literal["Enabled", "Disabled"] = Field(
        default="Enabled",
        description="`Enabled`: a NetworkPolicy the job owns admits to its pods only the job's own pods, the "
        "operator's pods (Jobs API and metrics ports) and the metrics scrapers the chart names "
        "(networkPolicy.metricsFrom; the job's namespace by default). `Disabled`: no policy is created.",
    )


class ResourceRequirements(_Spec):
    """CPU, memory and extended resources of a pod's container, as in a container's resources. GPUs come
    from the placements (under the role's gpuResourceName): do not set them here."""

    requests: dict[str, Quantity] | None = Field(
        default=None, description="Minimum resources, e.g. {cpu: 8, memory: 64Gi}."
    )
    limits: dict[str, Quantity] | None = Field(
        default=None,
        description="Maximum resources, e.g. {memory: 64Gi}; extended resources such as an RDMA device "
        "(rdma/ib: 1) go here (their request defaults to the limit).",
    )


# A quantity the operator can multiply by a GPU count: a plain decimal with an optional suffix (no exponent).
SCALABLE_QUANTITY_PATTERN = r"^[0-9]+(\.[0-9]+)?([numkMGTPE]|[KMGTPE]i)?$"
ScalableQuantity = int | Annotated[str, StringConstraints(pattern=SCALABLE_QUANTITY_PATTERN)]


class PerGpuResources(_Spec):
    """Resources per GPU, multiplied by the pod's GPU count (plain decimals with a suffix: 12, 120Gi, 500m)."""

    requests: dict[str, ScalableQuantity] | None = Field(default=None, description="Requests per GPU.")
    limits: dict[str, ScalableQuantity] | None = Field(default=None, description="Limits per GPU.")


class LocalObjectReference(_Spec):
    """A reference to an object in the job's namespace."""

    name: str = Field(min_length=1, description="Name of the object.")


K8S_TYPE_KEY: Final = "x-rlhf-k8s-type"
DEFAULT_GPU_RESOURCE: Final = "nvidia.com/gpu"
# An extended resource name as the API server accepts it: a domain prefix, then a name (MIG profiles too).
RESOURCE_NAME_PATTERN = r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"


_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]+)?)([a-zA-Z]*)$")


def scaled_quantity(quantity: Quantity, factor: int) -> str:
    """`quantity` times `factor`, in the same suffix: 12 -> 96, 120Gi -> 960Gi, 500m -> 4000m, 1.5 -> 12."""
    match = _QUANTITY.match(str(quantity))
    if match is None:
        raise ValueError(f"cannot scale the quantity {quantity!r}: write it as a number with a suffix")
    number, suffix = match.groups()
    value = float(number) * factor
    text = str(int(value)) if value.is_integer() else f"{value:g}"
    return text + suffix


def _k8s(kind: str, description: str) -> Any:
    """A field holding a Kubernetes core/v1 object (or a list of them): the CRD inlines Kubernetes' own
    schema of `kind` (k8s_schemas.py) where pydantic sees an open object."""
    return Field(default=None, description=description, json_schema_extra={K8S_TYPE_KEY: kind})


class PodSettings(_Spec):
    """Pod settings of one role (head, trainer or rollout), of the pods that talk NCCL (`pods.fabric`),
    or the job-wide defaults under `pods`.

    A role's value wins over the default: maps (nodeSelector, labels, annotations, resources) merge key by
    key; lists keyed by name (env, volumes, volumeMounts by mountPath, imagePullSecrets) merge by that key;
    tolerations and envFrom add up; securityContext and containerSecurityContext merge field by field over
    the restricted-profile defaults; affinity and the plain strings replace.
    """

    resources: ResourceRequirements | None = Field(
        default=None,
        description="CPU, memory and extended resources such as RDMA devices of the Ray container (GPUs "
        "are set from the placements).",
    )
    resources_per_gpu: PerGpuResources | None = Field(
        default=None,
        description="Resources per GPU of the pod (e.g. {cpu: 12, memory: 120Gi} per GPU), multiplied by "
        "the pod's GPU count; a key also in `resources` keeps `resources`' value. For a runtime, which cannot "
        "know how many GPUs each job's pods get. Ignored on pods without GPUs (the head).",
    )
    gpu_resource_name: str | None = Field(
        default=None,
        pattern=RESOURCE_NAME_PATTERN,
        description=f"Extended resource the GPUs are requested as (default {DEFAULT_GPU_RESOURCE}; "
        "amd.com/gpu, or a MIG profile such as nvidia.com/mig-3g.40gb).",
    )
    node_selector: dict[str, str] | None = Field(default=None, description="Node labels the pods must match.")
    tolerations: list[KubeObject] | None = _k8s("Toleration", "Pod tolerations (core/v1 Toleration).")
    affinity: KubeObject | None = _k8s(
        "Affinity", "Pod affinity (core/v1 Affinity); for rollout pods it replaces the default spread."
    )
    priority_class_name: str | None = Field(default=None, min_length=1, description="Pod priority class.")
    scheduler_name: str | None = Field(
        default=None, min_length=1, description="Scheduler of the pods (e.g. a gang scheduler)."
    )
    service_account_name: str | None = Field(
        default=None, min_length=1, description="Service account of the pods."
    )
    security_context: KubeObject | None = _k8s(
        "PodSecurityContext",
        "Pod security context (core/v1 PodSecurityContext), merged over the defaults: runAsNonRoot, uid "
        "and gid 10001 (the trainer image's user), fsGroup 10001, seccompProfile RuntimeDefault.",
    )
    container_security_context: KubeObject | None = _k8s(
        "SecurityContext",
        "Security context of the Ray container (core/v1 SecurityContext), merged over the defaults: no "
        "privilege escalation, every capability dropped. Adding one (IPC_LOCK for InfiniBand) leaves the "
        "restricted Pod Security Standard.",
    )
    env: list[KubeObject] | None = _k8s("EnvVar", "Extra environment variables (core/v1 EnvVar).")
    env_from: list[KubeObject] | None = _k8s(
        "EnvFromSource", "Environment from Secrets or ConfigMaps (core/v1 EnvFromSource), e.g. an HF token."
    )
    image_pull_secrets: list[LocalObjectReference] | None = Field(
        default=None, description="Secrets for pulling the trainer image."
    )
    volumes: list[KubeObject] | None = _k8s(
        "Volume", "Extra pod volumes (core/v1 Volume), e.g. a PVC holding models and checkpoints."
    )
    volume_mounts: list[KubeObject] | None = _k8s(
        "VolumeMount", "Mounts of those volumes in the Ray container (core/v1 VolumeMount)."
    )
    labels: dict[str, str] | None = Field(default=None, description="Extra labels on the pods.")
    annotations: dict[str, str] | None = Field(default=None, description="Extra annotations on the pods.")

    @field_validator(
        "tolerations",
        "affinity",
        "security_context",
        "container_security_context",
        "env",
        "env_from",
        "volumes",
        "volume_mounts",
    )
    @classmethod
    def _kubernetes_schema(cls, value: Any, info: ValidationInfo) -> Any:
        """The same check admission makes with Kubernetes' schema of the field's type (one source)."""
        if value is None or info.field_name is None:
            return value
        extra = cls.model_fields[info.field_name].json_schema_extra
        kind = str(extra[K8S_TYPE_KEY]) if isinstance(extra, dict) else ""
        node = k8s_schemas.schema(kind)
        found = (
            [p for i, v in enumerate(value) for p in k8s_schemas.problems(v, node, f"[{i}]")]
            if isinstance(value, list)
            else k8s_schemas.problems(value, node)
        )
        if found:
            raise ValueError(f"not a valid core/v1 {kind}: " + "; ".join(found[:5]))
        return value


class PodsSpec(PodSettings):
    """Pod settings: the fields here are job-wide defaults; `fabric` refines them for every pod that talks
    NCCL (trainer and rollout); `head`, `trainer` and `rollout` refine them for one role's pods (the head
    needs no GPU and can land on a CPU node, for example)."""

    fabric: PodSettings | None = Field(
        default=None,
        description="Settings of every pod that talks NCCL (the trainer and rollout pods, never the head), "
        "given once for both: RDMA device resources (e.g. rdma/ib in resources.limits), NCCL_* env, the "
        "network annotation, IPC_LOCK. Merged over the job-wide defaults; pods.trainer and pods.rollout "
        "merge over it.",
    )
    head: PodSettings | None = Field(default=None, description="The Ray head pod (runs the driver, no GPU).")
    trainer: PodSettings | None = Field(
        default=None, description="The trainer pods (actor, critic, reference and reward ranks)."
    )
    rollout: PodSettings | None = Field(default=None, description="The rollout (vLLM engine) pods.")


RuntimeKind = Literal["ClusterRLHFRuntime", "RLHFRuntime"]


class RuntimeRef(_Spec):
    """The platform runtime a job runs on (docs/runtimes.md): its images, pods, fabric, storage and job
    defaults are merged under the job's own fields, where the runtime lets the job set them."""

    kind: RuntimeKind = Field(
        default="ClusterRLHFRuntime",
        description="ClusterRLHFRuntime (cluster-wide, the platform team's) or RLHFRuntime (in the job's "
        "namespace).",
    )
    name: str = Field(min_length=1, max_length=253, description="Name of the runtime.")


# A Kubernetes object name (RFC 1123 subdomain), as a Secret's.
OBJECT_NAME_PATTERN: Final = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"


class S3StorageSpec(_Spec):
    """Credentials of the S3-compatible object store that `s3://` sources and exports use."""

    credentials_secret: str = Field(
        min_length=1,
        max_length=253,
        pattern=OBJECT_NAME_PATTERN,
        description="Name of a Secret in the job's namespace with the keys AWS_ACCESS_KEY_ID and "
        "AWS_SECRET_ACCESS_KEY, and optionally AWS_ENDPOINT_URL (an S3-compatible store other than AWS), "
        "AWS_REGION and AWS_SESSION_TOKEN. Every pod of the job (and so the driver) gets them as environment "
        "variables from the Secret; they are never copied into the spec, the RayCluster or the Ray job.",
    )


class HuggingFaceStorageSpec(_Spec):
    """Access to the Hugging Face Hub for `hf://` model sources."""

    token_secret: str | None = Field(
        default=None,
        min_length=1,
        max_length=253,
        pattern=OBJECT_NAME_PATTERN,
        description="Name of a Secret in the job's namespace whose key HF_TOKEN is a Hub token (needed for "
        "private and gated repositories). The fetch step gets it as the environment variable HF_TOKEN from "
        "the Secret; it is never copied into the spec or the RayCluster. Unset: public repositories only.",
    )


class ModelCacheSpec(_Spec):
    """Where `hf://` and `s3://` models are fetched to, once per source and revision (docs/models.md)."""

    claim_name: str = Field(
        min_length=1,
        max_length=253,
        pattern=OBJECT_NAME_PATTERN,
        description="Name of the PersistentVolumeClaim (in the job's namespace) holding the cache; the operator "
        "mounts it in every container of the job. ReadWriteMany, unless all the job's pods run on one node. "
        "Size it for the sum of the models' safetensors and tokenizer files, plus room for a second "
        "revision of each.",
    )
    mount_path: str = Field(
        default="/model-cache",
        pattern=r"^/\S*$",
        description="Where the operator mounts the claim in every container of the job (the fetch step's "
        "included); models load from <mountPath>/<hf|s3>/<source>/current.",
    )


class StorageSpec(_Spec):
    """Where the job's object-store and hub credentials come from (never from the spec itself), and the
    cache remote models are fetched into."""

    s3: S3StorageSpec | None = Field(
        default=None,
        description="The S3-compatible object store: needed by every `s3://` URL in the spec "
        "(model sources, data.prompts, data.eval.prompts, checkpoint.exportTo).",
    )
    hugging_face: HuggingFaceStorageSpec | None = Field(
        default=None, description="The Hugging Face Hub's token for `hf://` model sources."
    )
    model_cache: ModelCacheSpec | None = Field(
        default=None,
        description="The claim `hf://` and `s3://` models are fetched into before the trainer starts; "
        "required when a model field names one.",
    )


class RLHFJobSpec(_Spec):
    """Desired state of an RLHF training run."""

    runtime_ref: RuntimeRef | None = Field(
        default=None,
        description="The runtime the job runs on (docs/runtimes.md). The operator merges it under the job "
        "once, when the job starts, and records which generation it used in status.runtime: editing the "
        "runtime later changes no running job.",
    )
    image: str | None = Field(
        default=None,
        min_length=1,
        description="Trainer image for every pod; unset: the operator's default (the chart value "
        "jobDefaults.trainerImage, tagged with the chart's appVersion unless it names a tag).",
    )
    ray_version: str = Field(
        default="2.60.0", min_length=1, description="Ray version in the image (for KubeRay)."
    )
    model: ModelSpec = Field(description="The models: actor, critic, reference, reward.")
    algorithm: AlgorithmSpec = Field(default_factory=AlgorithmSpec, description="Algorithm and batch sizes.")
    data: DataSpec = Field(description="The prompt dataset.")
    trainer: TrainerSpec = Field(default_factory=TrainerSpec, description="Placement and DeepSpeed settings.")
    rollout: RolloutSpec = Field(default_factory=RolloutSpec, description="vLLM rollout engines.")
    weight_sync: WeightSyncSpec = Field(
        default_factory=WeightSyncSpec, description="Weight transport from the actor to the engines."
    )
    checkpoint: CheckpointSpec = Field(
        default_factory=CheckpointSpec, description="Checkpointing and resume."
    )
    evaluation: EvaluationSpec | None = Field(
        default=None,
        description="When and how the evaluation split (data.eval) runs. Unset with data.eval set: the "
        "defaults (after the last step only, greedy).",
    )
    monitoring: MonitoringSpec = Field(
        default_factory=MonitoringSpec, description="Metrics and stall detection."
    )
    tracking: TrackingSpec | None = Field(
        default=None,
        description="Experiment tracking (MLflow, W&B, TensorBoard); unset: Prometheus and the head's log only.",
    )
    run_policy: RunPolicySpec = Field(
        default_factory=RunPolicySpec, description="Suspend, restarts and deadlines."
    )
    pods: PodsSpec = Field(default_factory=PodsSpec, description="Pod template overrides.")
    storage: StorageSpec = Field(
        default_factory=StorageSpec,
        description="Credentials for object stores and the Hub, given to the job's pods from Secrets, and the "
        "model cache (docs/data.md, docs/models.md).",
    )
    security: SecuritySpec = Field(
        default_factory=SecuritySpec,
        description="Ray token authentication and the job's NetworkPolicy (both on by default).",
    )

    def evaluation_plan(self) -> EvaluationSpec | None:
        """When the evaluation split runs (spec.evaluation, or its defaults), or None without data.eval."""
        if self.data.eval is None:
            return None
        return self.evaluation or EvaluationSpec()

    def model_roles(self) -> list[Role]:
        """The models this run loads: actor always; critic for gae; reference when klCoef > 0; reward when
        the reward is a model."""
        roles: list[Role] = ["actor"]
        if self.algorithm.uses_critic:
            roles.append("critic")
        if self.algorithm.uses_reference:
            roles.append("reference")
        if self.model.reward.type == "model":
            roles.append("reward")
        return roles

    def model_sources(self) -> dict[str, str]:
        """The model each loaded role names, by spec field (`model.actor`, `model.reward.model`, ...): the
        sources the fetch step fetches and the trainer loads (model_source.py)."""
        named: dict[Role, tuple[str, str | None]] = {
            "actor": ("model.actor", self.model.actor),
            "critic": ("model.critic", self.model.critic),
            "reference": ("model.reference", self.model.reference),
            "reward": ("model.reward.model", self.model.reward.model),
        }
        return {name: uri for name, uri in (named[r] for r in self.model_roles()) if uri is not None}

    def gpu_groups(self) -> list[tuple[tuple[Role, ...], Placement]]:
        """Models that share GPUs, each group with its placement (that of its first member).

        Under colocateAll there is one group (and the rollout engines run on it too).
        """
        roles = self.model_roles()
        if self.trainer.colocate_all:
            return [(tuple(roles), self.trainer.actor)]
        groups: list[tuple[Role, ...]] = []
        taken: set[Role] = set()
        pairs: list[tuple[Role, Role, bool]] = [
            ("actor", "reference", self.trainer.actor_ref_colocated),
            ("critic", "reward", self.trainer.critic_reward_colocated),
        ]
        for first, second, colocated in pairs:
            if colocated and first in roles and second in roles:
                groups.append((first, second))
                taken.update((first, second))
        groups.extend((role,) for role in roles if role not in taken)
        groups.sort(key=lambda group: roles.index(group[0]))
        return [(group, self.trainer.placement(group[0])) for group in groups]


# --------------------------------------------------------------------------------------------- status


class Condition(_Status):
    """A condition in the standard metav1.Condition shape."""

    type: str = Field(min_length=1, max_length=316, description="Condition type, e.g. Ready or Stalled.")
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    observed_generation: int | None = Field(
        default=None, ge=0, description="metadata.generation the condition was computed from."
    )
    last_transition_time: datetime = Field(description="When status last changed.")
    reason: str = Field(
        min_length=1,
        max_length=1024,
        pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$",
        description="Machine-readable CamelCase reason for the last transition.",
    )
    message: str = Field(max_length=32768, description="Human-readable details.")


class GenerationShareSample(_Status):
    """The generation share of one completed step, as the autoscaler saw it."""

    step: int = Field(ge=1, description="Number of the completed step (status.step when it was read).")
    share: float = Field(ge=0, le=1, description="Fraction of that step spent in generation.")


class RolloutStatus(_Status):
    """Engine counts; readyEngines and selector back the scale subresource."""

    desired_engines: int | None = Field(
        default=None, ge=0, description="Engines the operator currently wants."
    )
    ready_engines: int | None = Field(
        default=None, ge=0, description="Engines serving (scale subresource status)."
    )
    selector: str | None = Field(
        default=None, description="Label selector of the rollout worker pods (scale subresource, for HPA)."
    )
    generation_share_history: list[GenerationShareSample] | None = Field(
        default=None,
        max_length=MAX_WINDOW_STEPS,
        description="Generation share of the most recent completed steps, oldest first, one entry per step "
        "the operator observed: the autoscaler's window, kept here so it survives operator restarts. "
        "A restart from a checkpoint drops the entries of the steps it re-runs.",
    )


class OpenStall(_Status):
    """A stall not yet over: set when the operator detects it, cleared when a later step completes."""

    phase: str = Field(description="The training phase the step was stuck in (`unknown` if not known).")
    step: int = Field(ge=0, description="The last step completed when the stall was detected.")
    since: datetime = Field(description="When the stall began: the last progress before it (step or start).")


class StallDiagnosis(_Status):
    """The stack snapshot of the latest stall (monitoring.stackSnapshotTimeoutSeconds)."""

    state: Literal["Taking", "Taken", "Failed", "TimedOut"] = Field(
        description="Taking: the snapshot's Ray job runs; Taken: its verdict is below and in the ConfigMap; "
        "Failed or TimedOut: no snapshot (message says why)."
    )
    stall_since: datetime = Field(description="openStall.since of the stall it diagnoses.")
    reason: str | None = Field(
        default=None, description="The Stalled condition's reason it was taken for (PhaseStuck:<phase>)."
    )
    submission_id: str = Field(description="Ray Jobs submission id of the snapshot.")
    requested_at: datetime = Field(description="When the operator asked for it.")
    seconds: float | None = Field(default=None, ge=0, description="From the request to the verdict.")
    summary: str | None = Field(default=None, description="Who is stuck where (the verdict), or why none.")
    config_map: str | None = Field(default=None, description="The ConfigMap holding the full dump.")


class RuntimeBinding(_Status):
    """The runtime a job was merged with, as it was when the job started (docs/runtimes.md)."""

    kind: RuntimeKind = Field(description="ClusterRLHFRuntime or RLHFRuntime.")
    name: str = Field(description="Name of the runtime.")
    generation: int = Field(ge=1, description="metadata.generation of the runtime the job uses.")
    snapshot: str = Field(description="The job-owned ConfigMap holding that generation's spec.")
    checkpoint_claim: str | None = Field(
        default=None,
        description="The per-job checkpoint PersistentVolumeClaim made from the runtime's template.",
    )


class ExportStatus(_Status):
    """The upload of the exported model to checkpoint.exportTo (docs/trainer.md)."""

    uri: str = Field(description="checkpoint.exportTo: the prefix the model goes to.")
    bytes_done: int = Field(ge=0, description="Bytes uploaded (or found there already, the same) so far.")
    bytes_total: int = Field(ge=0, description="Bytes of the export.")
    done: bool = Field(description="The marker is written: the prefix holds the complete model.")
    failed: bool = Field(
        default=False,
        description="The upload failed for good (after its retries): the model is only at exportPath; the "
        "driver's log says why.",
    )


class TrackingStatus(_Status):
    """Where each tracking sink keeps this run (reported by the trainer once the sink has started it)."""

    mlflow: str | None = Field(
        default=None, description="The MLflow run's URL: <trackingUri>/#/experiments/<id>/runs/<run id>."
    )
    wandb: str | None = Field(
        default=None,
        description="The W&B run's URL (online), or its run directory in the head pod (offline).",
    )
    tensorboard: str | None = Field(default=None, description="The TensorBoard log directory of the run.")
    link: str | None = Field(
        default=None,
        description="The first of mlflow, wandb and tensorboard that is set (the Tracking column of -o wide).",
    )


class AgentStatus(_Status):
    """rollout.agent's episodes in the last step (the trainer's rlhf_agent_* series)."""

    turns_per_episode: float = Field(ge=0, description="Mean model turns per episode.")
    tool_calls: int = Field(ge=0, description="Tool calls of the step's episodes.")
    tool_errors: int = Field(
        ge=0, description="Tool calls that raised or ran past rollout.agent.tool.timeoutSeconds."
    )
    tool_seconds: float = Field(ge=0, description="Seconds the step's tool calls ran, summed over the calls.")


class RLHFJobStatus(_Status):
    """Observed state, written by the operator."""

    phase: JobPhase | None = Field(default=None, description="Lifecycle phase of the job.")
    runtime: RuntimeBinding | None = Field(
        default=None, description="The runtime (and its generation) the job was merged with."
    )
    conditions: list[Condition] | None = Field(
        default=None,
        description="Standard conditions, one per type.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    message: str | None = Field(default=None, description="Human-readable reason for the current phase.")
    observed_generation: int | None = Field(
        default=None, ge=0, description="metadata.generation last reconciled."
    )
    ray_cluster_name: str | None = Field(default=None, description="Name of the job's RayCluster.")
    submission_id: str | None = Field(
        default=None, description="Ray Jobs submission id of the trainer entrypoint."
    )
    head_pod: str | None = Field(
        default=None,
        description="The Ray head pod the current attempt's driver runs on. When the RayCluster reports "
        "another head pod, or none, the driver and the GCS went with the old one and the attempt restarts.",
    )
    current_phase: str | None = Field(
        default=None,
        description="Training phase in progress (generation, reward, actor_train, ...), from the metrics.",
    )
    step: int | None = Field(default=None, ge=0, description="Completed steps.")
    total_steps: int | None = Field(
        default=None, ge=0, description="Steps the run will train (spec.algorithm.totalSteps)."
    )
    progress: str | None = Field(default=None, description="step/totalSteps, for the STEP printer column.")
    last_step_time: datetime | None = Field(default=None, description="When the last step completed.")
    phase_seconds: dict[str, float] | None = Field(
        default=None, description="Duration of each training phase in the last step, in seconds."
    )
    generation_share: float | None = Field(
        default=None, ge=0, le=1, description="Fraction of the last step spent in generation."
    )
    tokens_per_second: float | None = Field(
        default=None,
        ge=0,
        description="Generated tokens per wall-clock second between the last two observed steps.",
    )
    reward_mean: float | None = Field(default=None, description="Mean reward of the last step's samples.")
    eval_reward_mean: float | None = Field(
        default=None,
        description="Mean reward of the last evaluation of the data.eval split (rlhf_eval_reward_mean); unset "
        "before the first.",
    )
    eval_reward_mean_by_data_source: dict[str, float] | None = Field(
        default=None,
        description="The last evaluation's mean reward per data_source, when data.eval has that column.",
    )
    eval_step: int | None = Field(default=None, ge=0, description="Step after which the last evaluation ran.")
    export: ExportStatus | None = Field(
        default=None, description="The export's upload to checkpoint.exportTo (unset before one starts)."
    )
    tracking: TrackingStatus | None = Field(
        default=None, description="The run in each tracking sink (spec.tracking); unset before it starts."
    )
    kl: float | None = Field(default=None, description="KL divergence to the reference model, last step.")
    trainer_idle_ratio: float | None = Field(
        default=None, ge=0, le=1, description="Share of the last step the trainer waited for rollouts."
    )
    rollout_idle_ratio: float | None = Field(
        default=None,
        ge=0,
        le=1,
        description="Share of the last step the rollout engines were not generating.",
    )
    sample_staleness: float | None = Field(
        default=None,
        ge=0,
        description="Mean optimizer steps between a trained batch's generating weights and the policy trained "
        "on it, over this attempt (0 synchronous, 1 with algorithm.async).",
    )
    stale_samples: int | None = Field(
        default=None,
        ge=0,
        description="Samples older than algorithm.async.maxStaleness, regenerated or dropped (this attempt).",
    )
    generated_tokens: int | None = Field(
        default=None, ge=0, description="Tokens generated so far (at the last completed step observed)."
    )
    rollout: RolloutStatus | None = Field(default=None, description="Rollout engine counts.")
    agent: AgentStatus | None = Field(
        default=None,
        description="rollout.agent: turns per episode, tool calls, tool errors and tool seconds of the last "
        "step; unset for a job without agents.",
    )
    last_scale_time: datetime | None = Field(default=None, description="When the engine count last changed.")
    last_scale_step: int | None = Field(
        default=None,
        ge=0,
        description="Completed steps when the engine count last changed; the autoscaler counts only steps "
        "that started after it, which ran with the new count.",
    )
    restarts: int | None = Field(
        default=None, ge=0, description="Restarts so far (counted against backoffLimit)."
    )
    preemptions: int | None = Field(
        default=None,
        ge=0,
        description="Times Kueue evicted the admitted job (not counted against backoffLimit).",
    )
    last_restart_time: datetime | None = Field(default=None, description="When the job last restarted.")
    open_stall: OpenStall | None = Field(
        default=None,
        description="A stall that is not over: kept through an onStall restart until a later step "
        "completes (rlhf_operator_job_stalled, and the stall alert, follow it).",
    )
    diagnosis: StallDiagnosis | None = Field(
        default=None, description="The stack snapshot of the latest stall: which process is stuck where."
    )
    export_path: str | None = Field(
        default=None,
        description="Where the trained actor was exported as a Hugging Face model directory (set when the "
        "job succeeds with checkpoint.export other than never).",
    )
    last_checkpoint_step: int | None = Field(
        default=None,
        ge=0,
        description="Step of the newest complete checkpoint, as the trainer reports it "
        "(rlhf_last_checkpoint_step: written or resumed from); unset until it reports one.",
    )
    start_time: datetime | None = Field(default=None, description="When the job started running.")
    active_since: datetime | None = Field(
        default=None,
        description="Start of runPolicy.activeDeadlineSeconds: the job's creation or last unsuspension.",
    )
    completion_time: datetime | None = Field(default=None, description="When the job succeeded or failed.")


class Resource(BaseModel):
    """Base of the whole objects (RLHFJob, the runtimes): camelCase, unknown fields rejected, not strict
    (objects read from the API carry timestamps as strings)."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        validate_by_name=True,
        validate_by_alias=True,
        serialize_by_alias=True,
        extra="forbid",
    )


class RLHFJob(Resource):
    """A whole RLHFJob object. Status is optional: manifests have none, objects read from the API do."""

    api_version: Literal["rlhf.dev/v1alpha1"] = Field(default=API_VERSION, description="rlhf.dev/v1alpha1")
    kind: Literal["RLHFJob"] = Field(default=KIND, description="RLHFJob")
    metadata: KubeObject = Field(default_factory=dict, description="Standard object metadata.")
    spec: RLHFJobSpec = Field(description="Desired state.")
    status: RLHFJobStatus | None = Field(default=None, description="Observed state.")

    @property
    def name(self) -> str:
        """metadata.name ("" when the manifest uses generateName)."""
        return str(self.metadata.get("name", ""))

    @property
    def namespace(self) -> str:
        """metadata.namespace ("" when unset)."""
        return str(self.metadata.get("namespace", ""))
