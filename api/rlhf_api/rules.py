"""Cross-field rules of the RLHFJob spec, each defined once as data: a CEL expression for the CRD
(`x-kubernetes-validations`) and a Python predicate for `rlhf validate`, naming the same field with the
same message. Pure: imports only the spec model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from rlhf_api.model_source import parse_source
from rlhf_api.spec import GROUP_ESTIMATORS, Placement, RLHFJobSpec, Role

Reason = Literal["FieldValueInvalid", "FieldValueRequired", "FieldValueForbidden"]


@dataclass(frozen=True)
class Rule:
    """One cross-field constraint.

    `scope` is the camelCase path under `spec` where the CEL rule is attached (`self` is that object);
    `field` is the path under `spec` the error names. `check` returns True when the spec is valid.
    A `create_only` rule is checked when the object is created and not on updates, so that
    `kubectl scale` can move a field outside a range the operator then clamps.
    """

    name: str
    scope: str
    cel: str
    field: str
    message: str
    check: Callable[[Any], bool]  # RLHFJobSpec, or RLHFRuntimeSpec in runtime_spec.RUNTIME_RULES
    reason: Reason = "FieldValueInvalid"
    create_only: bool = False

    def __post_init__(self) -> None:
        if self.scope and not (self.field == self.scope or self.field.startswith(self.scope + ".")):
            raise ValueError(f"rule {self.name}: field {self.field} is outside its scope {self.scope}")

    @property
    def field_path(self) -> str:
        """The full path the error names, e.g. `spec.rollout.engines`."""
        return f"spec.{self.field}"

    @property
    def cel_field_path(self) -> str:
        """The field path relative to the scope, as `fieldPath` wants it (e.g. `.engines`)."""
        return "." + self.field[len(self.scope) + 1 :] if self.scope else "." + self.field

    def validation(self) -> dict[str, Any]:
        """The `x-kubernetes-validations` entry for this rule."""
        entry: dict[str, Any] = {
            "rule": f"oldSelf.hasValue() || ({self.cel})" if self.create_only else self.cel,
            "message": self.message,
            "fieldPath": self.cel_field_path,
            "reason": self.reason,
        }
        if self.create_only:
            entry["optionalOldSelf"] = True
        return entry


def _same(a: Placement | None, b: Placement) -> bool:
    """An unset placement defaults to its partner's, so it always matches."""
    return a is None or (a.nodes == b.nodes and a.gpus_per_node == b.gpus_per_node)


def _cel_same(field: str, other: str) -> str:
    """CEL for `_same`: placement `field` unset, or equal in nodes and gpusPerNode to placement `other`.

    `other` may be "critic|actor": the critic's placement if set, else the actor's. (A CEL conditional
    over the two objects would not type-check: each schema node is its own type, so compare the ints.)
    """

    def attr(name: str) -> str:
        if "|" not in other:
            return f"self.{other}.{name}"
        first, fallback = other.split("|")
        return f"(has(self.{first}) ? self.{first}.{name} : self.{fallback}.{name})"

    return (
        f"!has(self.{field}) || (self.{field}.nodes == {attr('nodes')}"
        f" && self.{field}.gpusPerNode == {attr('gpusPerNode')})"
    )


# Ranks of the actor group, and the data-parallel groups (shards of the rollout batch) of a group of R ranks:
# R / sequenceParallelSize when that divides R, else R (the group runs whole sequences). CEL has no
# functions of our own, so the expressions are spelt out; the predicates use the spec's own methods.
_CEL_ACTOR_RANKS = "(self.trainer.actor.nodes * self.trainer.actor.gpusPerNode)"


def _cel_data_parallel(ranks: str) -> str:
    """CEL for TrainerSpec.data_parallel_size(ranks)."""
    sp = "self.trainer.sequenceParallelSize"
    return f"({ranks} / ({ranks} % {sp} == 0 ? {sp} : 1))"


# The split models whose placement the trainer shards against the actor's: (role, CEL "the role runs").
_SPLIT_ROLES: tuple[tuple[Role, str], ...] = (
    ("critic", "self.algorithm.advantageEstimator == 'gae'"),
    ("reference", "self.algorithm.klCoef > 0.0"),
)


def _role_takes_whole_shards(spec: RLHFJobSpec, role: Role) -> bool:
    trainer = spec.trainer
    shards = trainer.data_parallel_size(trainer.actor.ranks)
    return (
        role not in spec.model_roles()
        or shards % trainer.data_parallel_size(trainer.placement(role).ranks) == 0
    )


def _split_role_rules() -> tuple[Rule, ...]:
    """Per critic/reference: its data-parallel groups divide the actor's, so each of its groups scores
    whole actor shards. (With sequence-parallel-divides-actor-ranks this also makes its ranks divide the
    actor's, so that needs no rule of its own.)"""
    rules: list[Rule] = []
    for role, runs in _SPLIT_ROLES:
        ranks = (
            f"(has(self.trainer.{role}) ? self.trainer.{role}.nodes * self.trainer.{role}.gpusPerNode"
            f" : {_CEL_ACTOR_RANKS})"
        )
        rules.append(
            Rule(
                name=f"{role}-takes-whole-actor-shards",
                scope="",
                cel=f"!({runs}) || {_cel_data_parallel(_CEL_ACTOR_RANKS)} % {_cel_data_parallel(ranks)} == 0",
                field=f"trainer.{role}",
                message=f"the {role}'s data-parallel groups must divide the actor's, so each scores whole actor "
                "shards (R ranks form R / sequenceParallelSize groups when that divides R, else R; so with "
                "sequenceParallelSize 1 its ranks must divide the actor's)",
                check=lambda s, role=role: _role_takes_whole_shards(s, role),  # type: ignore[misc]
            )
        )
    return tuple(rules)


_CEL_GROUP_ESTIMATORS = "[" + ", ".join(f"'{e}'" for e in GROUP_ESTIMATORS) + "]"

# The model fields (camelCase under spec.model) that may name a remote source; CEL sees unset ones as absent.
_MODEL_FIELDS = (("actor", True), ("critic", False), ("reference", False), ("reward.model", False))


def _cel_any_model(regex: str) -> str:
    """CEL: some set model field matches `regex` (CEL's global `matches`, RE2)."""
    terms = []
    for name, required in _MODEL_FIELDS:
        term = f"matches(self.model.{name}, '{regex}')"
        terms.append(term if required else f"(has(self.model.{name}) && {term})")
    return "(" + " || ".join(terms) + ")"


_CEL_ANY_REMOTE = _cel_any_model("^(hf|s3)://")
_CEL_ANY_S3 = _cel_any_model("^s3://")


def _model_uris(spec: RLHFJobSpec) -> list[str]:
    m = spec.model
    return [u for u in (m.actor, m.critic, m.reference, m.reward.model) if u is not None]


# CEL escapes property names that are CEL reserved words: `function` is reached as `__function__`.
def _has_s3_storage(spec: RLHFJobSpec, url: str | None) -> bool:
    """An s3:// URL has the store's credentials: spec.storage.s3, or a runtime that may give them (the
    merged spec is checked again when the job binds to it)."""
    if not url or not url.startswith("s3://"):
        return True
    return spec.storage.s3 is not None or spec.runtime_ref is not None


RULES: tuple[Rule, ...] = (
    Rule(
        name="reward-function-matches-type",
        scope="model.reward",
        cel="has(self.__function__) == (self.type == 'function')",
        field="model.reward.function",
        message="reward.function must be set when reward.type is function, and only then",
        check=lambda s: (s.model.reward.function is not None) == (s.model.reward.type == "function"),
    ),
    Rule(
        name="reward-model-matches-type",
        scope="model.reward",
        cel="has(self.model) == (self.type == 'model')",
        field="model.reward.model",
        message="reward.model must be set when reward.type is model, and only then",
        check=lambda s: (s.model.reward.model is not None) == (s.model.reward.type == "model"),
    ),
    Rule(
        name="reward-url-matches-type",
        scope="model.reward",
        cel="has(self.url) == (self.type == 'http')",
        field="model.reward.url",
        message="reward.url must be set when reward.type is http, and only then",
        check=lambda s: (s.model.reward.url is not None) == (s.model.reward.type == "http"),
    ),
    Rule(
        name="gae-needs-critic",
        scope="",
        cel="self.algorithm.advantageEstimator != 'gae' || has(self.model.critic)",
        field="model.critic",
        message="the gae advantage estimator needs a critic model; set model.critic or use a critic-free estimator "
        "(grpo, rloo, reinforce_pp, reinforce_pp_baseline)",
        reason="FieldValueRequired",
        check=lambda s: s.algorithm.advantage_estimator != "gae" or s.model.critic is not None,
    ),
    Rule(
        name="group-baseline-needs-samples",
        scope="algorithm",
        cel=f"!(self.advantageEstimator in {_CEL_GROUP_ESTIMATORS}) || self.samplesPerPrompt >= 2",
        field="algorithm.samplesPerPrompt",
        message="grpo, rloo and reinforce_pp_baseline compute a group baseline: samplesPerPrompt must be at "
        "least 2",
        check=lambda s: not s.algorithm.uses_groups or s.algorithm.samples_per_prompt >= 2,
    ),
    Rule(
        name="gspo-needs-whole-sequences",
        scope="",
        cel="self.algorithm.policyLoss != 'gspo' || self.trainer.sequenceParallelSize == 1",
        field="algorithm.policyLoss",
        message="gspo's ratio is over whole sequences, which sequence parallelism splits across ranks: use "
        "policyLoss ppo or trainer.sequenceParallelSize 1",
        check=lambda s: s.algorithm.policy_loss != "gspo" or s.trainer.sequence_parallel_size == 1,
    ),
    Rule(
        name="sequence-correction-needs-whole-sequences",
        scope="",
        cel="self.algorithm.rolloutCorrection.level != 'sequence' || self.trainer.sequenceParallelSize == 1",
        field="algorithm.rolloutCorrection.level",
        message="a sequence-level correction multiplies the weights of whole sequences, which sequence "
        "parallelism splits across ranks: use level token or trainer.sequenceParallelSize 1",
        check=lambda s: (
            s.algorithm.rollout_correction.level != "sequence" or s.trainer.sequence_parallel_size == 1
        ),
    ),
    Rule(
        name="rollout-correction-bounds-ordered",
        scope="algorithm.rolloutCorrection",
        cel="self.lowerBound < self.upperBound",
        field="algorithm.rolloutCorrection.lowerBound",
        message="rolloutCorrection.lowerBound must be below upperBound",
        check=lambda s: (
            s.algorithm.rollout_correction.lower_bound < s.algorithm.rollout_correction.upper_bound
        ),
    ),
    Rule(
        name="kl-target-needs-kl",
        scope="algorithm",
        cel="!has(self.klTarget) || self.klCoef > 0",
        field="algorithm.klTarget",
        message="klTarget adapts the KL coefficient from its starting value klCoef, which is 0 (no reference "
        "model): set klCoef above 0 or unset klTarget",
        check=lambda s: s.algorithm.kl_target is None or s.algorithm.kl_coef > 0,
    ),
    Rule(
        name="overlong-buffer-below-max-response",
        scope="algorithm",
        cel="!has(self.rewardShaping.overlongBuffer) || self.rewardShaping.overlongBuffer < "
        "self.maxResponseLength",
        field="algorithm.rewardShaping.overlongBuffer",
        message="rewardShaping.overlongBuffer must be below maxResponseLength (the penalty ramps over the "
        "last overlongBuffer tokens)",
        check=lambda s: (
            s.algorithm.reward_shaping.overlong_buffer is None
            or s.algorithm.reward_shaping.overlong_buffer < s.algorithm.max_response_length
        ),
    ),
    Rule(
        name="dynamic-sampling-needs-groups",
        scope="algorithm",
        cel=f"!self.dynamicSampling.enabled || self.advantageEstimator in {_CEL_GROUP_ESTIMATORS}",
        field="algorithm.dynamicSampling.enabled",
        message="dynamic sampling drops groups whose rewards are all equal, which only a group baseline makes "
        "useless: use grpo, rloo or reinforce_pp_baseline, or turn dynamicSampling off",
        check=lambda s: not s.algorithm.dynamic_sampling.enabled or s.algorithm.uses_groups,
    ),
    Rule(
        name="dynamic-sampling-not-async",
        scope="algorithm",
        cel="!self.dynamicSampling.enabled || !self.async.enabled",
        field="algorithm.dynamicSampling.enabled",
        message="dynamic sampling refills a batch on the critical path, which asynchronous RL does not wait "
        "for: turn off dynamicSampling or async",
        check=lambda s: not (s.algorithm.dynamic_sampling.enabled and s.algorithm.async_.enabled),
    ),
    Rule(
        name="train-micro-batch-divides-step",
        scope="algorithm",
        cel="(self.rolloutBatchSize * self.samplesPerPrompt) % self.trainMicroBatchSize == 0",
        field="algorithm.trainMicroBatchSize",
        message="trainMicroBatchSize must divide the samples per step (rolloutBatchSize x samplesPerPrompt)",
        check=lambda s: s.algorithm.samples_per_step % s.algorithm.train_micro_batch_size == 0,
    ),
    Rule(
        name="rollout-micro-batch-divides-step",
        scope="algorithm",
        cel="(self.rolloutBatchSize * self.samplesPerPrompt) % self.rolloutMicroBatchSize == 0",
        field="algorithm.rolloutMicroBatchSize",
        message="rolloutMicroBatchSize must divide the samples per step (rolloutBatchSize x samplesPerPrompt)",
        check=lambda s: s.algorithm.samples_per_step % s.algorithm.rollout_micro_batch_size == 0,
    ),
    Rule(
        name="sequence-parallel-divides-actor-ranks",
        scope="trainer",
        cel="(self.actor.nodes * self.actor.gpusPerNode) % self.sequenceParallelSize == 0",
        field="trainer.sequenceParallelSize",
        message="sequenceParallelSize must divide the actor's ranks (nodes x gpusPerNode)",
        check=lambda s: s.trainer.actor.ranks % s.trainer.sequence_parallel_size == 0,
    ),
    Rule(
        name="rollout-batch-splits-over-actor-shards",
        scope="",
        cel=f"self.algorithm.rolloutBatchSize % {_cel_data_parallel(_CEL_ACTOR_RANKS)} == 0",
        field="algorithm.rolloutBatchSize",
        message="rolloutBatchSize must be a multiple of the actor's data-parallel groups (trainer.actor "
        "ranks / sequenceParallelSize), so every group trains on whole prompts",
        check=lambda s: (
            s.algorithm.rollout_batch_size % s.trainer.data_parallel_size(s.trainer.actor.ranks) == 0
        ),
    ),
    Rule(
        name="mini-batches-divide-actor-shard",
        scope="",
        cel="(self.algorithm.rolloutBatchSize * self.algorithm.samplesPerPrompt / "
        f"{_cel_data_parallel(_CEL_ACTOR_RANKS)}) % self.algorithm.miniBatchesPerEpoch == 0",
        field="algorithm.miniBatchesPerEpoch",
        message="miniBatchesPerEpoch must divide the samples of each actor data-parallel group "
        "(rolloutBatchSize x samplesPerPrompt / (trainer.actor ranks / sequenceParallelSize)), so every rank "
        "takes the same number of optimizer steps",
        check=lambda s: (
            (s.algorithm.samples_per_step // s.trainer.data_parallel_size(s.trainer.actor.ranks))
            % s.algorithm.mini_batches_per_epoch
            == 0
        ),
    ),
    *_split_role_rules(),
    Rule(
        name="async-needs-own-engine-devices",
        scope="",
        cel="!self.algorithm.async.enabled || !self.trainer.colocateAll",
        field="algorithm.async.enabled",
        message="asynchronous RL generates the next batch while the actor trains, so the rollout engines need "
        "their own devices: turn off trainer.colocateAll or algorithm.async.enabled",
        check=lambda s: not (s.algorithm.async_.enabled and s.trainer.colocate_all),
    ),
    Rule(
        name="async-engines-stay-awake",
        scope="",
        cel="!self.algorithm.async.enabled || !self.rollout.enableSleep",
        field="algorithm.async.enabled",
        message="asynchronous RL generates while the actor trains, so the engines cannot sleep then: turn off "
        "rollout.enableSleep or algorithm.async.enabled",
        check=lambda s: not (s.algorithm.async_.enabled and s.rollout.enable_sleep),
    ),
    Rule(
        name="colocate-all-matches-engines",
        scope="",
        cel="!self.trainer.colocateAll || self.trainer.actor.nodes * self.trainer.actor.gpusPerNode"
        " == self.rollout.engines * self.rollout.tensorParallelSize",
        field="trainer.colocateAll",
        message="colocateAll needs the actor's ranks (nodes x gpusPerNode) to equal "
        "rollout.engines x rollout.tensorParallelSize",
        check=lambda s: (
            not s.trainer.colocate_all
            or s.trainer.actor.ranks == s.rollout.engines * s.rollout.tensor_parallel_size
        ),
    ),
    Rule(
        name="colocate-all-implies-actor-ref",
        scope="trainer",
        cel="!self.colocateAll || !has(self.colocateActorRef) || self.colocateActorRef",
        field="trainer.colocateActorRef",
        message="colocateActorRef cannot be false when colocateAll is true (colocateAll colocates every model)",
        check=lambda s: not s.trainer.colocate_all or s.trainer.colocate_actor_ref is not False,
    ),
    Rule(
        name="colocate-all-implies-critic-reward",
        scope="trainer",
        cel="!self.colocateAll || !has(self.colocateCriticReward) || self.colocateCriticReward",
        field="trainer.colocateCriticReward",
        message="colocateCriticReward cannot be false when colocateAll is true (colocateAll colocates every model)",
        check=lambda s: not s.trainer.colocate_all or s.trainer.colocate_critic_reward is not False,
    ),
    Rule(
        name="colocated-reference-placement",
        scope="trainer",
        cel="!(self.colocateAll || (has(self.colocateActorRef) && self.colocateActorRef)) || ("
        + _cel_same("reference", "actor")
        + ")",
        field="trainer.reference",
        message="a reference colocated with the actor must have the actor's placement (or none)",
        check=lambda s: not s.trainer.actor_ref_colocated or _same(s.trainer.reference, s.trainer.actor),
    ),
    Rule(
        name="colocate-all-critic-placement",
        scope="trainer",
        cel="!self.colocateAll || (" + _cel_same("critic", "actor") + ")",
        field="trainer.critic",
        message="with colocateAll the critic must have the actor's placement (or none)",
        check=lambda s: not s.trainer.colocate_all or _same(s.trainer.critic, s.trainer.actor),
    ),
    Rule(
        name="colocated-reward-placement",
        scope="trainer",
        cel="!(self.colocateAll || (has(self.colocateCriticReward) && self.colocateCriticReward)) || ("
        + _cel_same("reward", "critic|actor")
        + ")",
        field="trainer.reward",
        message="a reward model colocated with the critic must have the critic's placement (or none)",
        check=lambda s: (
            not s.trainer.critic_reward_colocated or _same(s.trainer.reward, s.trainer.placement("critic"))
        ),
    ),
    Rule(
        name="cuda-ipc-needs-colocate-all",
        scope="",
        cel="self.weightSync.backend != 'cuda_ipc' || self.trainer.colocateAll",
        field="weightSync.backend",
        message="the cuda_ipc backend shares GPU memory, so it needs trainer.colocateAll",
        check=lambda s: s.weight_sync.backend != "cuda_ipc" or s.trainer.colocate_all,
    ),
    Rule(
        name="tensor-parallel-divides-worker",
        scope="rollout",
        cel="!has(self.gpusPerWorker) || self.gpusPerWorker % self.tensorParallelSize == 0",
        field="rollout.tensorParallelSize",
        message="tensorParallelSize must divide gpusPerWorker (a worker runs gpusPerWorker / "
        "tensorParallelSize engines)",
        check=lambda s: s.rollout.worker_gpus % s.rollout.tensor_parallel_size == 0,
    ),
    Rule(
        name="engines-fill-whole-workers",
        scope="rollout",
        cel="!has(self.gpusPerWorker) || (self.engines * self.tensorParallelSize) % self.gpusPerWorker == 0",
        field="rollout.engines",
        message="engines x tensorParallelSize must be a whole number of rollout workers (a multiple of "
        "gpusPerWorker)",
        check=lambda s: (s.rollout.engines * s.rollout.tensor_parallel_size) % s.rollout.worker_gpus == 0,
    ),
    Rule(
        name="autoscaling-min-at-most-max",
        scope="rollout.autoscaling",
        cel="self.minEngines <= self.maxEngines",
        field="rollout.autoscaling.minEngines",
        message="minEngines must not exceed maxEngines",
        check=lambda s: s.rollout.autoscaling.min_engines <= s.rollout.autoscaling.max_engines,
    ),
    Rule(
        name="autoscaling-hysteresis-below-target",
        scope="rollout.autoscaling",
        cel="self.hysteresis < self.targetGenerationShare",
        field="rollout.autoscaling.hysteresis",
        message="hysteresis must be smaller than targetGenerationShare (the scale-down threshold is "
        "target - hysteresis)",
        check=lambda s: s.rollout.autoscaling.hysteresis < s.rollout.autoscaling.target_generation_share,
    ),
    Rule(
        name="engines-within-autoscaling-range",
        scope="rollout",
        cel="!self.autoscaling.enabled || (self.engines >= self.autoscaling.minEngines"
        " && self.engines <= self.autoscaling.maxEngines)",
        field="rollout.engines",
        message="with autoscaling enabled, engines must be within [minEngines, maxEngines] when the job is "
        "created (later scale requests are clamped by the operator)",
        check=lambda s: (
            not s.rollout.autoscaling.enabled
            or s.rollout.autoscaling.min_engines <= s.rollout.engines <= s.rollout.autoscaling.max_engines
        ),
        create_only=True,
    ),
    Rule(
        name="autoscaling-excludes-colocate-all",
        scope="",
        cel="!(self.rollout.autoscaling.enabled && self.trainer.colocateAll)",
        field="rollout.autoscaling.enabled",
        message="autoscaling cannot be enabled with trainer.colocateAll (the engines are tied to the actor's GPUs)",
        check=lambda s: not (s.rollout.autoscaling.enabled and s.trainer.colocate_all),
    ),
    Rule(
        name="evaluation-needs-eval-split",
        scope="",
        cel="!has(self.evaluation) || has(self.data.eval)",
        field="data.eval",
        message="evaluation needs an evaluation split: set data.eval.prompts, or remove spec.evaluation",
        reason="FieldValueRequired",
        check=lambda s: s.evaluation is None or s.data.eval is not None,
    ),
    Rule(
        name="evaluation-runs-sometime",
        scope="evaluation",
        cel="has(self.everySteps) || self.atEnd",
        field="evaluation.atEnd",
        message="evaluation would never run: set evaluation.everySteps, or leave atEnd true",
        check=lambda s: s.evaluation is None or s.evaluation.every_steps is not None or s.evaluation.at_end,
    ),
    Rule(
        name="eval-samples-need-temperature",
        scope="evaluation.sampling",
        cel="self.samplesPerPrompt == 1 || self.temperature > 0.0",
        field="evaluation.sampling.samplesPerPrompt",
        message="evaluation.sampling.samplesPerPrompt above 1 needs a temperature above 0 (greedy decoding "
        "gives one response per prompt)",
        check=lambda s: (
            s.evaluation is None
            or s.evaluation.sampling.samples_per_prompt == 1
            or s.evaluation.sampling.temperature > 0
        ),
    ),
    Rule(
        name="eval-max-tokens-within-max-response",
        scope="",
        cel="!has(self.evaluation) || !has(self.evaluation.sampling) || "
        "!has(self.evaluation.sampling.maxTokens) || "
        "self.evaluation.sampling.maxTokens <= self.algorithm.maxResponseLength",
        field="evaluation.sampling.maxTokens",
        message="evaluation.sampling.maxTokens must be at most algorithm.maxResponseLength (the engines' "
        "context is sized from it)",
        check=lambda s: (
            s.evaluation is None
            or s.evaluation.sampling.max_tokens is None
            or s.evaluation.sampling.max_tokens <= s.algorithm.max_response_length
        ),
    ),
    Rule(
        name="s3-prompts-need-storage",
        scope="",
        cel="!self.data.prompts.startsWith('s3://') || has(self.runtimeRef) || "
        "(has(self.storage) && has(self.storage.s3))",
        field="data.prompts",
        message="an s3:// data.prompts needs the object store's credentials: set "
        "spec.storage.s3.credentialsSecret",
        reason="FieldValueRequired",
        check=lambda s: _has_s3_storage(s, s.data.prompts),
    ),
    Rule(
        name="s3-eval-prompts-need-storage",
        scope="",
        cel="!has(self.data.eval) || !self.data.eval.prompts.startsWith('s3://') || has(self.runtimeRef) || "
        "(has(self.storage) && has(self.storage.s3))",
        field="data.eval.prompts",
        message="an s3:// data.eval.prompts needs the object store's credentials: set "
        "spec.storage.s3.credentialsSecret",
        reason="FieldValueRequired",
        check=lambda s: s.data.eval is None or _has_s3_storage(s, s.data.eval.prompts),
    ),
    Rule(
        name="export-to-needs-storage",
        scope="",
        cel="!has(self.checkpoint.exportTo) || has(self.runtimeRef) || (has(self.storage) && has(self.storage.s3))",
        field="checkpoint.exportTo",
        message="checkpoint.exportTo needs the object store's credentials: set spec.storage.s3.credentialsSecret",
        reason="FieldValueRequired",
        check=lambda s: _has_s3_storage(s, s.checkpoint.export_to),
    ),
    Rule(
        name="export-to-needs-an-export",
        scope="",
        # A runtime's checkpoint volume gives checkpoint.path (docs/runtimes.md): a runtime-bound job
        # names none of its own.
        cel="!has(self.checkpoint.exportTo) || ((has(self.checkpoint.path) || has(self.runtimeRef)) && "
        "self.checkpoint.export != 'never')",
        field="checkpoint.exportTo",
        message="checkpoint.exportTo uploads the export: it needs checkpoint.path (or a runtime's checkpoint "
        "volume) and an export other than never",
        check=lambda s: (
            s.checkpoint.export_to is None
            or (
                s.checkpoint.export != "never"
                and (s.checkpoint.path is not None or s.runtime_ref is not None)
            )
        ),
    ),
    Rule(
        name="tracking-needs-a-sink",
        scope="",
        cel="!has(self.tracking) || has(self.tracking.mlflow) || has(self.tracking.wandb) || "
        "has(self.tracking.tensorboard)",
        field="tracking",
        message="tracking needs a sink: set tracking.mlflow, tracking.wandb or tracking.tensorboard, or "
        "remove spec.tracking",
        reason="FieldValueRequired",
        check=lambda s: s.tracking is None or bool(s.tracking.sinks()),
    ),
    Rule(
        name="wandb-online-needs-api-key",
        scope="tracking.wandb",
        cel="self.mode == 'offline' || has(self.apiKeySecret)",
        field="tracking.wandb.apiKeySecret",
        message="tracking.wandb in mode online needs apiKeySecret (a Secret with WANDB_API_KEY); or set "
        "mode: offline",
        reason="FieldValueRequired",
        check=lambda s: (
            s.tracking is None
            or s.tracking.wandb is None
            or s.tracking.wandb.mode == "offline"
            or s.tracking.wandb.api_key_secret is not None
        ),
    ),
    Rule(
        name="agent-max-tokens-within-max-response",
        scope="",
        cel="!has(self.rollout.agent) || self.rollout.agent.maxTokens <= self.algorithm.maxResponseLength",
        field="rollout.agent.maxTokens",
        message="rollout.agent.maxTokens must be at most algorithm.maxResponseLength (an episode's model and "
        "tool tokens are its response: the engines' and the trainer's context is sized from it)",
        check=lambda s: (
            s.rollout.agent is None or s.rollout.agent.max_tokens <= s.algorithm.max_response_length
        ),
    ),
    Rule(
        name="stall-timeout-spans-scrapes",
        scope="monitoring",
        cel="self.stallTimeoutSeconds >= 2 * self.scrapeIntervalSeconds",
        field="monitoring.stallTimeoutSeconds",
        message="stallTimeoutSeconds must be at least 2 x scrapeIntervalSeconds",
        check=lambda s: s.monitoring.stall_timeout_seconds >= 2 * s.monitoring.scrape_interval_seconds,
    ),
    Rule(
        name="startup-timeout-covers-a-step",
        scope="monitoring",
        cel="!has(self.startupTimeoutSeconds) || self.startupTimeoutSeconds >= self.stallTimeoutSeconds",
        field="monitoring.startupTimeoutSeconds",
        message="startupTimeoutSeconds must be at least stallTimeoutSeconds (it covers start-up and the first step)",
        check=lambda s: (
            s.monitoring.startup_timeout_seconds is None
            or s.monitoring.startup_timeout_seconds >= s.monitoring.stall_timeout_seconds
        ),
    ),
    Rule(
        name="remote-model-needs-cache",
        scope="",
        # A runtime's writable model cache is the job's (rlhf_api.runtime_merge checks it is there).
        cel=f"!{_CEL_ANY_REMOTE} || has(self.runtimeRef) || (has(self.storage) && has(self.storage.modelCache))",
        field="storage.modelCache",
        message="a model from hf:// or s3:// is fetched into the model cache before the trainer starts: set "
        "storage.modelCache (a PersistentVolumeClaim and its mount path)",
        reason="FieldValueRequired",
        check=lambda s: (
            s.storage.model_cache is not None
            or s.runtime_ref is not None
            or not any(parse_source(u).remote for u in _model_uris(s))
        ),
    ),
    Rule(
        name="s3-model-needs-credentials",
        scope="",
        cel=f"!{_CEL_ANY_S3} || has(self.runtimeRef) || (has(self.storage) && has(self.storage.s3))",
        field="storage.s3",
        message="a model from s3:// needs the object store's credentials: set storage.s3.credentialsSecret",
        reason="FieldValueRequired",
        check=lambda s: all(_has_s3_storage(s, u) for u in _model_uris(s)),
    ),
)


def violated(spec: RLHFJobSpec, *, creating: bool = True) -> list[Rule]:
    """The rules `spec` breaks. With `creating=False` (an update), create-only rules are skipped."""
    return [rule for rule in RULES if (creating or not rule.create_only) and not rule.check(spec)]


@dataclass(frozen=True)
class UpdateRule:
    """A rule on how a field may change (a CEL transition rule, on `oldSelf`). Only the API server sees the
    old object, so there is no Python twin: `rlhf validate` checks one manifest, and the operator never
    sees a refused update."""

    name: str
    scope: str
    cel: str
    field: str
    message: str

    def validation(self) -> dict[str, Any]:
        return {
            "rule": self.cel,
            "message": self.message,
            "fieldPath": "." + self.field[len(self.scope) + 1 :] if self.scope else "." + self.field,
            "reason": "FieldValueForbidden",
        }


UPDATE_RULES: tuple[UpdateRule, ...] = (
    UpdateRule(
        name="runtime-ref-fixed",
        scope="",
        cel="has(self.runtimeRef) == has(oldSelf.runtimeRef) && "
        "(!has(self.runtimeRef) || self.runtimeRef == oldSelf.runtimeRef)",
        field="runtimeRef",
        message="runtimeRef cannot be added, removed or changed once the job exists (the job was bound to "
        "its runtime when it started): create a new job",
    ),
)
