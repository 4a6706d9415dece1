"""Names both sides of the RLHFJob contract must agree on, beyond the spec: the Ray custom resources a
RayCluster's worker pods advertise (the operator writes them, the trainer places its groups on them).
Constants only: no imports, no logic.
"""

from __future__ import annotations

from typing import Final

# Advertised by the trainer worker group's pods (rayStartParams.resources); the driver places model ranks on them.
TRAINER_RESOURCE: Final = "rlhf_trainer_slot"
# Advertised by the rollout worker group's pods; the engine pool counts them to size itself.
ROLLOUT_RESOURCE: Final = "rlhf_rollout_slot"
