"""The RLHFJob model: defaults, wire names, strictness, the helpers other modules use, and the rules
as Python predicates (the same rules' CEL side is checked in test_crd.py and against a real API server)."""

from __future__ import annotations

import ast
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError
from rlhf_api import spec as spec_module
from rlhf_api.rules import RULES, violated
from rlhf_api.spec import (
    JOB_PHASES,
    Placement,
    RLHFJob,
    RLHFJobSpec,
    RLHFJobStatus,
    RolloutSpec,
)

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def minimal(**overrides: Any) -> dict[str, Any]:
    """The smallest valid spec (wire form), with top-level sections replaced by `overrides`."""
    spec: dict[str, Any] = {
        "model": {"actor": "/models/a", "reward": {"type": "function", "function": "rewards:score"}},
        "data": {"prompts": "/data/p.jsonl"},
    }
    spec.update(overrides)
    return spec


def example(name: str) -> RLHFJob:
    return RLHFJob.model_validate(yaml.safe_load((ROOT / "examples" / name).read_text()))


def test_minimal_spec_gets_documented_defaults() -> None:
    spec = RLHFJobSpec.model_validate(minimal())
    assert spec.image is None  # the operator's default (jobDefaults.trainerImage) applies
    assert spec.ray_version == "2.60.0"
    assert spec.trainer.zero_stage == 3
    assert spec.trainer.packing is True
    assert spec.trainer.sequence_parallel_size == 1
    assert spec.rollout.engines == 1
    assert spec.rollout.gpus_per_worker is None
    assert spec.monitoring.metrics_port == 9400
    assert spec.weight_sync.backend == "auto"
    assert spec.checkpoint.resume == "auto"
    assert spec.data.input_key == "prompt"
    assert spec.algorithm.advantage_estimator == "grpo"
    assert violated(spec) == []


def test_wire_names_are_camel_case_with_lambda_and_mib() -> None:
    dumped = RLHFJobSpec.model_validate(minimal()).model_dump(by_alias=True)
    assert "lambda" in dumped["algorithm"]
    assert "lam" not in dumped["algorithm"]
    assert "bucketSizeMiB" in dumped["weightSync"]
    assert "samplesPerPrompt" in dumped["algorithm"]
    assert "runPolicy" in dumped and "ttlSecondsAfterFinished" in dumped["runPolicy"]


def test_dump_by_alias_round_trips() -> None:
    job = example("rlhfjob-llama-8b.yaml")
    again = RLHFJobSpec.model_validate(job.spec.model_dump(by_alias=True, mode="json"))
    assert again == job.spec
    json_again = RLHFJobSpec.model_validate_json(job.spec.model_dump_json(by_alias=True))
    assert json_again == job.spec


def test_python_names_also_construct_the_model() -> None:
    spec = RolloutSpec(engines=4, tensor_parallel_size=2)
    assert spec.engines == 4 and spec.tensor_parallel_size == 2


@pytest.mark.parametrize(
    ("section", "value"),
    [
        ("rollout", {"engines": "4"}),
        ("rollout", {"enableSleep": "true"}),
        ("model", {"actor": 123, "reward": {"type": "function", "function": "r:f"}}),
        ("weightSync", {"bucketSizeMiB": 1.5}),
    ],
)
def test_no_type_coercion_like_the_api_server(section: str, value: Any) -> None:
    with pytest.raises(ValidationError):
        RLHFJobSpec.model_validate(minimal(**{section: value}))


def test_unknown_fields_are_rejected() -> None:
    with pytest.raises(ValidationError, match="enginesCount"):
        RLHFJobSpec.model_validate(minimal(rollout={"enginesCount": 2}))


def test_spec_is_frozen() -> None:
    spec = RLHFJobSpec.model_validate(minimal())
    with pytest.raises(ValidationError):
        spec.rollout.engines = 3  # type: ignore[misc]


def test_placement_ranks_and_role_defaults() -> None:
    spec = RLHFJobSpec.model_validate(
        minimal(trainer={"actor": {"nodes": 2, "gpusPerNode": 8}, "critic": {"nodes": 1, "gpusPerNode": 4}})
    )
    assert spec.trainer.actor.ranks == 16
    assert spec.trainer.placement("reference") == Placement(nodes=2, gpus_per_node=8)
    assert spec.trainer.placement("critic").ranks == 4
    # The reward model defaults to the critic's placement, which may itself be the actor's.
    assert spec.trainer.placement("reward") == spec.trainer.placement("critic")
    bare = RLHFJobSpec.model_validate(minimal(trainer={"actor": {"nodes": 3}}))
    assert bare.trainer.placement("reward") == bare.trainer.actor


@pytest.mark.parametrize(
    ("rollout", "replicas", "per_worker"),
    [
        ({"engines": 3}, 3, 1),
        ({"engines": 4, "tensorParallelSize": 2}, 4, 1),
        ({"engines": 4, "tensorParallelSize": 2, "gpusPerWorker": 4}, 2, 2),
        ({"engines": 4, "tensorParallelSize": 1, "gpusPerWorker": 8}, 1, 8),
    ],
)
def test_rollout_replicas_are_worker_pods(rollout: dict[str, Any], replicas: int, per_worker: int) -> None:
    spec = RLHFJobSpec.model_validate(minimal(rollout=rollout)).rollout
    assert spec.replicas() == replicas
    assert spec.engines_per_worker == per_worker


def test_rollout_replicas_round_up_for_another_engine_count() -> None:
    rollout = RolloutSpec.model_validate({"engines": 4, "tensorParallelSize": 2, "gpusPerWorker": 4})
    assert rollout.worker_gpus == 4
    assert rollout.replicas(5) == 3
    assert rollout.replicas(1) == 1


def test_samples_per_step_and_estimator_needs() -> None:
    algorithm = RLHFJobSpec.model_validate(
        minimal(algorithm={"rolloutBatchSize": 32, "samplesPerPrompt": 8, "klCoef": 0})
    ).algorithm
    assert algorithm.samples_per_step == 256
    assert algorithm.uses_critic is False
    assert algorithm.uses_reference is False


def test_model_roles_and_gpu_groups_of_the_8b_example() -> None:
    spec = example("rlhfjob-llama-8b.yaml").spec
    assert spec.model_roles() == ["actor", "critic", "reference", "reward"]
    groups = spec.gpu_groups()
    assert groups == [
        (("actor", "reference"), Placement(nodes=2, gpus_per_node=8)),
        (("critic", "reward"), Placement(nodes=1, gpus_per_node=8)),
    ]
    assert spec.rollout.replicas() == 2
    assert spec.model.reference_path == "/models/llama-3.1-8b-sft"


def test_colocate_all_makes_one_gpu_group() -> None:
    spec = RLHFJobSpec.model_validate(
        minimal(trainer={"actor": {"gpusPerNode": 2}, "colocateAll": True}, rollout={"engines": 2})
    )
    assert spec.trainer.actor_ref_colocated and spec.trainer.critic_reward_colocated
    assert spec.gpu_groups() == [(("actor", "reference"), Placement(nodes=1, gpus_per_node=2))]
    assert violated(spec) == []


def test_grpo_example_has_no_critic_group() -> None:
    spec = example("rlhfjob-grpo.yaml").spec
    assert [roles for roles, _ in spec.gpu_groups()] == [("actor", "reference")]


def test_job_name_namespace_and_status() -> None:
    job = RLHFJob.model_validate(
        {
            "apiVersion": "rlhf.dev/v1alpha1",
            "kind": "RLHFJob",
            "metadata": {"name": "j", "namespace": "team-a"},
            "spec": minimal(),
            "status": {
                "phase": "Running",
                "step": 3,
                "totalSteps": 10,
                "progress": "3/10",
                "lastStepTime": "2026-11-23T09:00:00Z",
                "phaseSeconds": {"generation": 1.5, "actor_train": 2},
                "rollout": {"desiredEngines": 2, "readyEngines": 1, "selector": "a=b"},
                "conditions": [
                    {
                        "type": "Ready",
                        "status": "True",
                        "lastTransitionTime": "2026-11-23T09:00:00Z",
                        "reason": "Running",
                        "message": "",
                    }
                ],
            },
        }
    )
    assert (job.name, job.namespace) == ("j", "team-a")
    assert job.status is not None and job.status.rollout is not None
    assert job.status.rollout.ready_engines == 1
    assert job.status.last_step_time == datetime(2026, 11, 23, 9, tzinfo=UTC)
    dumped = job.status.model_dump(by_alias=True, exclude_none=True, mode="json")
    assert dumped["phaseSeconds"] == {"generation": 1.5, "actor_train": 2.0}
    assert dumped["lastStepTime"] == "2026-11-23T09:00:00Z"
    assert dumped["conditions"][0]["lastTransitionTime"] == "2026-11-23T09:00:00Z"


def test_status_rejects_unknown_phase_and_bad_reason() -> None:
    with pytest.raises(ValidationError):
        RLHFJobStatus.model_validate({"phase": "Exploded"})
    with pytest.raises(ValidationError):
        RLHFJobStatus.model_validate(
            {
                "conditions": [
                    {
                        "type": "Ready",
                        "status": "True",
                        "lastTransitionTime": "2026-11-23T09:00:00Z",
                        "reason": "has spaces",
                        "message": "",
                    }
                ]
            }
        )
    assert len(JOB_PHASES) == 9


def test_spec_module_imports_only_pydantic_and_stdlib() -> None:
    tree = ast.parse(Path(spec_module.__file__).read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module if node.module == "rlhf_api" else node.module.split(".")[0])
    # rlhf_api.k8s_schemas (`from rlhf_api import k8s_schemas`) is itself standard library only.
    assert imported <= {"__future__", "math", "re", "datetime", "typing", "pydantic", "rlhf_api"}, imported
    k8s_tree = ast.parse((Path(spec_module.__file__).parent / "k8s_schemas.py").read_text())
    k8s_imported = {
        (n.module or "").split(".")[0] if isinstance(n, ast.ImportFrom) else a.name.split(".")[0]
        for n in ast.walk(k8s_tree)
        if isinstance(n, ast.Import | ast.ImportFrom)
        for a in n.names
    }
    assert k8s_imported <= {"__future__", "argparse", "json", "sys", "functools", "pathlib", "typing"}, (
        k8s_imported
    )


# ---- the rules as Python predicates ------------------------------------------------------------


def test_rule_names_are_unique_and_fields_exist_in_the_model() -> None:
    assert len({rule.name for rule in RULES}) == len(RULES)
    dumped = RLHFJobSpec.model_json_schema(by_alias=True)
    for rule in RULES:
        node: dict[str, Any] = dumped
        for part in rule.field.split("."):
            props = node.get("properties") or dumped["$defs"][node["$ref"].rsplit("/", 1)[-1]]["properties"]
            assert part in props, f"{rule.name}: {rule.field}"
            node = props[part]
            if "anyOf" in node:
                node = next(b for b in node["anyOf"] if b.get("type") != "null")


def test_engine_range_is_checked_on_create_only() -> None:
    spec = RLHFJobSpec.model_validate(
        minimal(rollout={"engines": 9, "autoscaling": {"enabled": True, "minEngines": 1, "maxEngines": 4}})
    )
    assert [rule.name for rule in violated(spec)] == ["engines-within-autoscaling-range"]
    assert violated(spec, creating=False) == []
    create_only = [rule.name for rule in RULES if rule.create_only]
    assert create_only == ["engines-within-autoscaling-range"]


def test_explicit_true_fine_flags_agree_with_colocate_all() -> None:
    spec = RLHFJobSpec.model_validate(
        minimal(trainer={"colocateAll": True, "colocateActorRef": True, "colocateCriticReward": True})
    )
    assert violated(spec) == []


def test_reward_colocation_compares_with_the_critic_or_the_actor() -> None:
    # No critic placement: the reward model must match the actor's.
    base = {"actor": {"gpusPerNode": 4}, "colocateCriticReward": True}
    ok = RLHFJobSpec.model_validate(minimal(trainer={**base, "reward": {"gpusPerNode": 4}}))
    bad = RLHFJobSpec.model_validate(minimal(trainer={**base, "reward": {"gpusPerNode": 2}}))
    assert violated(ok) == []
    assert [rule.field for rule in violated(bad)] == ["trainer.reward"]


def test_whole_worker_rule_uses_the_default_worker_size() -> None:
    spec = RLHFJobSpec.model_validate(minimal(rollout={"engines": 3, "tensorParallelSize": 2}))
    assert violated(spec) == []


# ---- batch geometry: the data-parallel groups a step is sharded over -----------------------------


def names(spec: dict[str, Any]) -> list[str]:
    return [rule.name for rule in violated(RLHFJobSpec.model_validate(spec))]


def test_data_parallel_groups_are_sequence_parallel_blocks() -> None:
    trainer = RLHFJobSpec.model_validate(minimal(trainer={"sequenceParallelSize": 2})).trainer
    assert [trainer.data_parallel_size(r) for r in (1, 2, 3, 4, 8)] == [1, 1, 3, 2, 4]


def test_rollout_batch_must_split_over_the_actor_data_parallel_groups() -> None:
    batch = {"trainMicroBatchSize": 2, "rolloutMicroBatchSize": 2}
    two_ranks = {"actor": {"gpusPerNode": 2}}
    assert names(minimal(algorithm={**batch, "rolloutBatchSize": 4}, trainer=two_ranks)) == []
    assert names(minimal(algorithm={**batch, "rolloutBatchSize": 3}, trainer=two_ranks)) == [
        "rollout-batch-splits-over-actor-shards"
    ]
    # Sequence parallelism over both ranks makes them one group: 3 prompts split over 1.
    one_block = {**two_ranks, "sequenceParallelSize": 2}
    assert names(minimal(algorithm={**batch, "rolloutBatchSize": 3}, trainer=one_block)) == []


def test_critic_and_reference_must_take_whole_actor_shards() -> None:
    gae = {"advantageEstimator": "gae", "klCoef": 0}
    critic = {"actor": {"gpusPerNode": 4}, "critic": {"gpusPerNode": 3}}
    with_critic = {"actor": "/a", "critic": "/c", "reward": {"type": "function", "function": "r:f"}}
    assert names(minimal(model=with_critic, algorithm=gae, trainer=critic)) == [
        "critic-takes-whole-actor-shards"
    ]
    # The critic is not loaded under grpo, so its placement does not matter.
    assert names(minimal(model=with_critic, algorithm={"klCoef": 0}, trainer=critic)) == []
    # 2 critic ranks divide 4 actor ranks; under SP 4 the actor is 1 shard and the critic (whole
    # sequences: 4 does not divide 2) is 2: indivisible although the ranks divide.
    split = {"actor": {"gpusPerNode": 4}, "critic": {"gpusPerNode": 2}, "sequenceParallelSize": 4}
    assert names(minimal(model=with_critic, algorithm=gae, trainer=split)) == [
        "critic-takes-whole-actor-shards"
    ]
    reference = {"actor": {"gpusPerNode": 4}, "reference": {"gpusPerNode": 3}}
    assert names(minimal(trainer=reference)) == ["reference-takes-whole-actor-shards"]  # klCoef 0.01
    assert names(minimal(algorithm={"klCoef": 0}, trainer=reference)) == []  # no reference model


def test_agent_is_absent_by_default_and_has_documented_defaults() -> None:
    assert RLHFJobSpec.model_validate(minimal()).rollout.agent is None  # today's single-turn rollout
    spec = RLHFJobSpec.model_validate(
        minimal(
            algorithm={"maxResponseLength": 256},
            rollout={"agent": {"function": "examples/agents/calculator.py:run_episode", "maxTokens": 256}},
        )
    )
    agent = spec.rollout.agent
    assert agent is not None
    assert (agent.max_turns, agent.max_tokens, agent.max_episodes_per_engine) == (4, 256, 16)
    assert (agent.tool.timeout_seconds, agent.tool.workers) == (10.0, 4)
    assert violated(spec) == []
    wire = spec.model_dump(exclude_unset=False)["rollout"]["agent"]
    assert set(wire) == {"function", "maxTurns", "maxTokens", "maxEpisodesPerEngine", "tool"}
    assert set(wire["tool"]) == {"timeoutSeconds", "workers"}


def test_agent_budget_must_fit_the_response_context() -> None:
    def agent_spec(max_tokens: int) -> RLHFJobSpec:
        return RLHFJobSpec.model_validate(
            minimal(
                algorithm={"maxResponseLength": 128},
                rollout={"agent": {"function": "agents:run", "maxTokens": max_tokens}},
            )
        )

    assert violated(agent_spec(128)) == []
    assert [r.name for r in violated(agent_spec(129))] == ["agent-max-tokens-within-max-response"]
