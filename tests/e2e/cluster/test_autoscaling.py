"""Rollout-engine scaling against the real control plane and operator: the scale subresource drives the
RayCluster's rollout group, out-of-range requests are clamped with an Event, unplaceable workers set
EnginesPending, and the built-in policy scales on the generation share.

No real trainer runs here (that is the trainer suite's job). Before the operator starts, each test
submits a stand-in Ray job under the submission id the operator would use, so the operator adopts it as
the running trainer; where metrics matter, a STAND-IN FOR THE TRAINER'S /metrics (the trainer's own
`rlhf_trainer.metrics.TrainerExporter`, the docs/monitoring.md contract, served by prometheus_client from this process)
reports the steps and phase timings the test dictates.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import start_http_server
from rlhf_operator import rayjobs
from rlhf_trainer.metrics import TrainerExporter
from testkit.support import (
    Cluster,
    OperatorProcess,
    RayHead,
    events,
    example_job,
    free_port,
    job_status,
    rollout_replicas,
    submit_standin_trainer,
    wait_for,
)

pytestmark = pytest.mark.cluster


def event_with(cluster: Cluster, ns: str, name: str, reason: str, text: str = "") -> dict[str, Any] | None:
    return next(
        (e for e in events(cluster, ns, name) if e.get("reason") == reason and text in e.get("message", "")),
        None,
    )


def _job_condition(cluster: Cluster, ns: str, name: str, ctype: str) -> dict[str, Any] | None:
    conds = job_status(cluster, ns, name).get("conditions", [])
    return next((c for c in conds if c.get("type") == ctype), None)


@contextmanager
def adopted_job(
    cluster: Cluster, ray_head: RayHead, ns: str, doc: dict[str, Any], log: Path
) -> Iterator[OperatorProcess]:
    """Create the job, submit a sleeping stand-in as its trainer's Ray job, then start the operator.

    The operator submits idempotently under a deterministic id, so it finds the stand-in RUNNING and
    takes it as the trainer; starting the operator only afterwards makes that race-free.
    """
    cluster.apply(doc, ns)
    sid = submit_standin_trainer(cluster, ns, doc["metadata"]["name"])
    op = OperatorProcess(cluster, log)
    op.start()
    try:
        yield op
    finally:
        op.stop()
        print(f"--- operator log tail ---\n{op.log_tail(60)}")
        with rayjobs.RayJobsClient(ray_head.dashboard_url) as rj:
            rj.stop(sid)


def scale(cluster: Cluster, ns: str, name: str, replicas: int) -> None:
    cluster.kubectl("scale", "-n", ns, f"rlhfjob/{name}", f"--replicas={replicas}")


def test_kubectl_scale_drives_the_rollout_group_and_out_of_range_is_clamped(
    cluster: Cluster, rlhf_crd: str, ray_head: RayHead, namespace: str, tmp_path: Path
) -> None:
    # 4 GPUs a rollout worker; the trainer group takes 2 x 2 of the 2 x 8 fake GPUs, so 4 workers
    # (16 GPUs) can never all be placed, and 2 always can.
    doc = example_job(
        "scaled",
        **{
            "spec.rollout": {
                "engines": 1,
                "tensorParallelSize": 4,
                "autoscaling": {"enabled": True, "minEngines": 1, "maxEngines": 4, "windowSteps": 50},
            },
            "spec.monitoring": {
                "metricsPort": free_port(),
                "stallTimeoutSeconds": 600,
                "scrapeIntervalSeconds": 1,
            },
        },
    )
    ns = namespace
    with adopted_job(cluster, ray_head, ns, doc, tmp_path / "operator.log"):
        wait_for(lambda: job_status(cluster, ns, "scaled").get("phase") == "Running", 90, "phase Running")
        assert rollout_replicas(cluster, ns, "scaled") == 1

        # kubectl scale goes through the scale subresource (spec.rollout.engines).
        scale(cluster, ns, "scaled", 2)
        wait_for(lambda: rollout_replicas(cluster, ns, "scaled") == 2, 30, "the rollout group at 2 replicas")
        assert event_with(
            cluster, ns, "scaled", "EnginesScaled", "spec.rollout.engines 1→2: rollout workers 1→2"
        )
        wait_for(
            lambda: job_status(cluster, ns, "scaled").get("rollout", {}).get("desiredEngines") == 2,
            30,
            "status.rollout.desiredEngines 2",
        )
        wait_for(
            lambda: len(cluster.list("pods", ns, selector="rlhf.dev/job=scaled,rlhf.dev/role=rollout")) == 2,
            30,
            "two rollout worker pods",
        )

        # Out of range: the API server accepts it (the range rule is create-only), the operator clamps it.
        scale(cluster, ns, "scaled", 9)
        clamped = wait_for(
            lambda: event_with(cluster, ns, "scaled", "EnginesClamped"), 30, "an EnginesClamped Event"
        )
        assert clamped["type"] == "Warning"
        assert clamped["message"] == (
            "requested 9 engines, above rollout.autoscaling.maxEngines 4: running 4 (engines 2→4)"
        )
        wait_for(
            lambda: (cluster.get("rlhfjob", "scaled", ns) or {})["spec"]["rollout"]["engines"] == 4,
            30,
            "spec.rollout.engines clamped to 4",
        )
        wait_for(lambda: rollout_replicas(cluster, ns, "scaled") == 4, 30, "the rollout group at 4 replicas")
        scale_obj = json.loads(
            cluster.kubectl(
                "get", "--raw", f"/apis/rlhf.dev/v1alpha1/namespaces/{ns}/rlhfjobs/scaled/scale"
            ).stdout
        )
        assert scale_obj["spec"]["replicas"] == 4

        # The fourth worker cannot be placed: the job keeps running and a condition says why.
        pending = wait_for(
            lambda: (
                (c := _job_condition(cluster, ns, "scaled", "EnginesPending")) and c["status"] == "True" and c
            ),
            60,
            "EnginesPending=True",
        )
        assert pending["reason"] == "Unschedulable"
        assert "for 4 engines cannot be scheduled" in pending["message"]
        assert "nvidia.com/gpu" in pending["message"]
        assert job_status(cluster, ns, "scaled")["phase"] == "Running"

        # Back within what the cluster can place: the condition clears.
        scale(cluster, ns, "scaled", 1)
        cleared = wait_for(
            lambda: (
                (c := _job_condition(cluster, ns, "scaled", "EnginesPending"))
                and c["status"] == "False"
                and c
            ),
            60,
            "EnginesPending=False",
        )
        assert cleared["reason"] == "AllScheduled"
        assert rollout_replicas(cluster, ns, "scaled") == 1


def test_built_in_policy_scales_up_when_generation_bound_and_back_down(
    cluster: Cluster, rlhf_crd: str, ray_head: RayHead, namespace: str, tmp_path: Path
) -> None:
    """The stand-in for the trainer's /metrics reports steps whose generation share the test sets."""
    port = free_port()
    doc = example_job(
        "auto",
        **{
            "spec.rollout": {
                "engines": 1,
                "autoscaling": {
                    "enabled": True,
                    "minEngines": 1,
                    "maxEngines": 2,
                    "targetGenerationShare": 0.5,
                    "hysteresis": 0.1,
                    "windowSteps": 2,
                    "cooldownSeconds": 0,
                },
            },
            "spec.monitoring": {"metricsPort": port, "stallTimeoutSeconds": 600, "scrapeIntervalSeconds": 1},
        },
    )
    trainer = TrainerExporter("auto")  # stand-in: the trainer's metric contract, served from this process
    trainer.total_steps.labels("auto").set(20)
    trainer.stall_timeout.labels("auto").set(600)
    trainer.set_engines({"ready": 1})
    server, thread = start_http_server(port, addr="127.0.0.1", registry=trainer.registry)
    ns = namespace
    step = 0

    def complete_step(generation: float, train: float) -> None:
        nonlocal step
        trainer.step_done({"generation": generation, "actor_train": train}, generation + train)
        step += 1
        wait_for(
            lambda: job_status(cluster, ns, "auto").get("step") == step,
            30,
            f"the operator to see step {step}",
        )

    def engines() -> int:
        return int((cluster.get("rlhfjob", "auto", ns) or {})["spec"]["rollout"]["engines"])

    try:
        with adopted_job(cluster, ray_head, ns, doc, tmp_path / "operator.log"):
            wait_for(lambda: job_status(cluster, ns, "auto").get("phase") == "Running", 90, "phase Running")
            complete_step(8.0, 2.0)  # 80% generation: above 50% + 10%
            assert engines() == 1, "one step is not the 2-step window"
            complete_step(8.0, 2.0)
            up = wait_for(
                lambda: event_with(cluster, ns, "auto", "GenerationBound"), 30, "a GenerationBound Event"
            )
            assert up["message"] == "generation 80% > 60% (target 50% + 10%) for 2 steps: engines 1→2"
            assert engines() == 2
            wait_for(
                lambda: rollout_replicas(cluster, ns, "auto") == 2, 30, "the rollout group at 2 replicas"
            )
            st = job_status(cluster, ns, "auto")
            assert st["lastScaleStep"] == 2 and st["rollout"]["desiredEngines"] == 2
            trainer.set_engines({"ready": 2})  # the elastic pool picked up the new worker

            # Step 3 was already running with one engine: only steps 4 and 5 count for the next decision.
            complete_step(2.0, 8.0)  # 20% generation: below 50% - 10%
            complete_step(2.0, 8.0)
            assert engines() == 2 and event_with(cluster, ns, "auto", "TrainingBound") is None
            complete_step(2.0, 8.0)
            down = wait_for(
                lambda: event_with(cluster, ns, "auto", "TrainingBound"), 30, "a TrainingBound Event"
            )
            assert down["message"] == "generation 20% < 40% (target 50% - 10%) for 2 steps: engines 2→1"
            assert engines() == 1
            wait_for(lambda: rollout_replicas(cluster, ns, "auto") == 1, 30, "the rollout group at 1 replica")
            history = job_status(cluster, ns, "auto")["rollout"]["generationShareHistory"]
            assert [h["step"] for h in history] == [4, 5]
    finally:
        server.shutdown()
        thread.join(5)
