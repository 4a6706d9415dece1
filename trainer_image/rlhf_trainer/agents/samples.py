"""Trajectories as the trainer's samples: a `PackedRollout` (the prompt is the prompt, every token after it
the response) and, beside it, the response tokens' loss mask, packed like `rollout_logprobs`.

Owns the mapping of an episode's tokens onto the trainer's layout, and laying the loss mask out as the loss
reads it (`loss_mask_at`: the padded [B, T-1] micro-batch of `deepspeed_utils.response_logprobs`). The
trainer's policy loss multiplies its action mask by that (see the note in `loss_mask_at`). Pure torch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rlhf_trainer.agents.contract import Trajectory
from rlhf_trainer.data import Prompt
from rlhf_trainer.transfer import PackedRollout, pad_response_values

Sample = tuple[list[int], list[int], list[float]]  # PackedRollout.from_samples: prompt, response, log-probs


def trainer_sample(trajectory: Trajectory) -> tuple[Sample, list[int]]:
    """(prompt ids, response ids, response log-probs) as an engine's sample today, and the response's
    loss mask: the trajectory's tokens after the prompt are the response, tool tokens included."""
    sample = (list(trajectory.prompt_ids), list(trajectory.token_ids), list(trajectory.logprobs))
    return sample, list(trajectory.loss_mask)


def pack_trajectories(
    trajectories: Sequence[Trajectory], groups: Sequence[int], prompts: Sequence[Prompt] = ()
) -> tuple[PackedRollout, torch.Tensor]:
    """A chunk's trajectories as a PackedRollout (texts: each trajectory's decoded tokens; finished: its
    last model turn stopped by itself) and its loss mask, float32 over response tokens in the packed order
    of `rollout_logprobs` ([sum(response_lens)])."""
    pairs = [trainer_sample(t) for t in trajectories]
    packed = PackedRollout.from_samples(
        [s for s, _ in pairs],
        groups,
        prompts,
        [t.text for t in trajectories],
        [t.finished for t in trajectories],
    )
    mask = torch.tensor([m for _, ms in pairs for m in ms], dtype=torch.float32)
    return packed, mask


def loss_mask_at(loss_mask: torch.Tensor, action_mask: torch.Tensor) -> torch.Tensor:
    """A micro-batch's packed response loss mask laid out as its action mask [B, T-1] (0 off the responses):
    the mask the policy loss takes is action_mask * valid * this. Today (policy.py) it is action_mask *
    valid: tool tokens would be trained as if the model had sampled them. Wiring this in is the one line
    `mask = mask * out.local(loss_mask[sl])` there, plus the counts built from response lengths instead of
    a mask (optim_steps.plan's normaliser, sequence_tokens, experience's KL and whitening): see
    docs/agents.md when written, and the report of the session that built this."""
    return pad_response_values(loss_mask.to(torch.float32), action_mask.cpu()).to(action_mask.device)
