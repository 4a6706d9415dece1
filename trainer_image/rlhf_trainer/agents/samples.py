"""Trajectories as the trainer's samples: a `PackedRollout` (the prompt is the prompt, every token after it
the response) whose `loss_mask` marks the model's tokens (1) and the tools' (0), packed like
`rollout_logprobs`.

Owns the mapping of an episode's tokens onto the trainer's layout. The trainer reads the mask from the
rollout (`PackedRollout.model_mask`): the losses, their normalisers, the advantages and the KL take only the
model's tokens. Pure torch.
"""

from __future__ import annotations

from collections.abc import Sequence

from rlhf_trainer.agents.contract import Trajectory
from rlhf_trainer.data import Prompt
from rlhf_trainer.transfer import PackedRollout


def pack_trajectories(
    trajectories: Sequence[Trajectory],
    groups: Sequence[int],
    prompts: Sequence[Prompt] = (),
    labels: Sequence[object] = (),
) -> PackedRollout:
    """A chunk's trajectories as a PackedRollout: each trajectory's tokens after its prompt are the response
    (tool tokens included), with its loss mask; texts: each trajectory's decoded tokens; finished: its last
    model turn stopped by itself."""
    return PackedRollout.from_samples(
        [(list(t.prompt_ids), list(t.token_ids), list(t.logprobs)) for t in trajectories],
        groups,
        prompts,
        [t.text for t in trajectories],
        [t.finished for t in trajectories],
        labels,
        loss_masks=[list(t.loss_mask) for t in trajectories],
    )
