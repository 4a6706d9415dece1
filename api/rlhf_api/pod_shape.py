"""The job's pods as the operator renders them and the trainer places on them: how many trainer and
rollout pods, and the GPUs of each. Pure; the one definition both sides (manifests, `rlhf plan`) use.
"""

from __future__ import annotations

from rlhf_api.spec import RLHFJobSpec


def trainer_pods(spec: RLHFJobSpec) -> tuple[int, int]:
    """(pods, GPUs per pod) of the trainer worker group: one pod per node of every GPU group, each with
    the largest gpusPerNode."""
    groups = spec.gpu_groups()
    pods = sum(placement.nodes for _, placement in groups)
    gpus = max(placement.gpus_per_node for _, placement in groups)
    return pods, gpus


def rollout_pods(spec: RLHFJobSpec, engines: int | None = None) -> tuple[int, int]:
    """(pods, GPUs per pod) of the rollout worker group for `engines` engines (default the spec's); none
    when every model is colocated with the engines on the trainer pods."""
    if spec.trainer.colocate_all:
        return 0, 0
    return spec.rollout.replicas(engines), spec.rollout.worker_gpus
