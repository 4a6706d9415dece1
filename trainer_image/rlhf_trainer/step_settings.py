"""What the driver sends the actor and critic ranks each step: the advantage and loss settings, typed.

Frozen dataclasses with no defaults: every value comes from the spec (`config.algorithm_settings`),
whose model holds the only defaults, or from the driver's state (the adaptive KL, the score moments,
the step). Data only: no torch, no Ray.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RolloutCorrection:
    """spec.algorithm.rolloutCorrection when enabled: pi_prox / pi_behav per token or sequence
    (algorithms.rollout_weights)."""

    level: str
    mode: str
    lower: float
    upper: float


@dataclass(frozen=True)
class RewardShaping:
    """spec.algorithm.rewardShaping, and the response length its overlong penalty counts from."""

    clip: float | None
    overlong_buffer: int | None
    overlong_penalty: float
    max_response_length: int
    normalize: bool
    mask_truncated: bool


@dataclass(frozen=True)
class AlgorithmSettings:
    """One step's advantage and loss settings (spec.algorithm), plus the driver's state: `kl_coef` is the
    adaptive controller's, `score_moments` the running normalisation's, `step` the step being trained."""

    estimator: str
    grpo_scale: bool
    kl_coef: float
    kl_in_loss: bool
    kl_reward_estimator: str
    kl_loss_estimator: str
    gamma: float
    lam: float
    policy_loss: str
    clip_low: float
    clip_high: float
    dual_clip: float | None
    entropy_coef: float
    value_clip: float
    epochs: int
    mini_batches: int
    loss_aggregation: str
    norm_constant: float  # seq-mean-token-sum-norm (Dr. GRPO): the maximum response length
    train_micro_batch: int
    skip_old_logprobs: bool
    correction: RolloutCorrection | None
    shaping: RewardShaping
    score_moments: dict[str, float] | None
    step: int | None
