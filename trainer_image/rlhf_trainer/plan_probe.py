"""The probe `rlhf plan` places for each rank, reward model and engine (rlhf_trainer.device_map).

A module of its own that imports only the standard library at import time: Ray ships the probe by
reference, so each probe worker imports this module, and the device map's own imports (the spec,
torch through the config) cost about 2 CPU-seconds per worker, one worker per pod of the job.
"""

from __future__ import annotations

import os
from typing import Any


def probe() -> dict[str, Any]:
    """Stands in for a rank, the reward model or an engine (or one of a TP engine's workers): a task, so
    the few worker processes Ray starts are reused (placement shows the same: a bundle pins its GPU)."""
    import ray

    return {
        "node_id": ray.get_runtime_context().get_node_id(),
        "gpus": [int(g) for g in ray.get_gpu_ids()],
        "pid": os.getpid(),
    }
