"""`rlhf validate --runtime RUNTIME JOB...` (rlhf_api.validate): the runtime file's own schema and rules,
then each job merged over it as the operator will merge it, every problem naming its field; the exit
status and the printed lines."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from rlhf_api.runtime_spec import AnyRuntime, ClusterRLHFRuntime, RLHFRuntime
from rlhf_api.validate import (
    Issue,
    load_runtime,
    validate_file,
    validate_on_runtime,
    validate_runtime_manifest,
)
from rlhf_cli.main import main as cli_main
from testkit.support import minimal_job

pytestmark = [pytest.mark.unit, pytest.mark.runtime]


def runtime_manifest(kind: str = "ClusterRLHFRuntime", **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "rlhf.dev/v1alpha1", "kind": kind, "metadata": {"name": "rt"}, "spec": spec}


def runtime(kind: str = "ClusterRLHFRuntime", namespace: str | None = None, **spec: Any) -> AnyRuntime:
    manifest = runtime_manifest(kind, **spec)
    if namespace:
        manifest["metadata"]["namespace"] = namespace
    model = ClusterRLHFRuntime if kind == "ClusterRLHFRuntime" else RLHFRuntime
    return model.model_validate(manifest)


def on(kind: str = "ClusterRLHFRuntime", name: str = "rt", **spec: Any) -> dict[str, Any]:
    """A valid job naming the runtime `kind/name`."""
    return minimal_job("job", runtimeRef={"kind": kind, "name": name}, **spec)


def write(path: Path, *documents: Any) -> str:
    path.write_text(yaml.safe_dump_all(documents))
    return str(path)


# ---- the runtime file ---------------------------------------------------------------------------------


def test_a_runtime_is_checked_by_its_schema_and_its_rules() -> None:
    assert validate_runtime_manifest(runtime_manifest(images={"cpu": "c:1"})) == []
    bad = runtime_manifest("RLHFRuntime", images={"cpus": "c:1"}, overridable=["algorithm.klCoeff"])
    assert validate_runtime_manifest(bad) == [
        Issue("spec.images.cpus", "unknown field (not in the RLHFRuntime schema)"),
        Issue("spec.overridable", "Value error, 'algorithm.klCoeff' is not a field of the RLHFJob spec"),
    ]
    [rule] = validate_runtime_manifest(runtime_manifest(storage={"checkpoints": {"mountPath": "/c"}}))
    assert rule.path == "spec.storage.checkpoints.claimName" and "exactly one" in rule.message


def test_a_runtime_has_a_runtime_kind_and_a_name() -> None:
    manifest = runtime_manifest()
    manifest["kind"], manifest["metadata"] = "RLHFJob", {}
    assert [issue.path for issue in validate_runtime_manifest(manifest)] == ["kind", "metadata.name"]


def test_job_defaults_are_checked_with_the_runtime() -> None:
    [issue] = validate_runtime_manifest(runtime_manifest(jobDefaults={"pods": {"nodeSelector": {"a": "b"}}}))
    assert issue.path == "spec.jobDefaults" and "pods is not a job default" in issue.message
    [issue] = validate_runtime_manifest(runtime_manifest(jobDefaults={"monitoring": {"stallTimeout": 1}}))
    assert issue.path == "spec.jobDefaults" and "monitoring.stallTimeout" in issue.message


def test_a_runtime_file_holds_one_valid_runtime(tmp_path: Path) -> None:
    loaded, issues = load_runtime(write(tmp_path / "rt.yaml", runtime_manifest()))
    assert isinstance(loaded, ClusterRLHFRuntime) and issues == []
    loaded, issues = load_runtime(write(tmp_path / "two.yaml", runtime_manifest(), runtime_manifest()))
    assert loaded is None and "one runtime" in issues[0].message
    loaded, issues = load_runtime(write(tmp_path / "bad.yaml", runtime_manifest(images={"gpu": ""})))
    assert loaded is None and [i.path for i in issues] == ["spec.images.gpu"]


# ---- a job on it --------------------------------------------------------------------------------------


def test_a_job_on_its_runtime_is_valid() -> None:
    assert validate_on_runtime(on(algorithm={"klCoef": 0.05}), runtime(images={"cpu": "c:1"})) == []


def test_the_jobs_own_problems_come_first() -> None:
    assert validate_on_runtime(on(rollout={"engines": 0}), runtime()) == [
        Issue("spec.rollout.engines", "Input should be greater than or equal to 1")
    ]


def test_a_field_the_runtime_keeps_is_named_with_the_runtime() -> None:
    [issue] = validate_on_runtime(on(pods={"priorityClassName": "mine"}), runtime())
    assert issue.path == "spec.pods.priorityClassName"
    assert "ClusterRLHFRuntime/rt does not let jobs set this field" in issue.message


@pytest.mark.parametrize(
    ("job", "names"),
    [
        (minimal_job("job"), "it names no runtime"),
        (on(name="other"), "it names ClusterRLHFRuntime/other"),
        (on(kind="RLHFRuntime"), "it names RLHFRuntime/rt"),
    ],
)
def test_the_job_must_name_the_runtime_it_is_validated_on(job: dict[str, Any], names: str) -> None:
    [issue] = validate_on_runtime(job, runtime())
    assert issue.path == "spec.runtimeRef"
    assert issue.message == f"must name ClusterRLHFRuntime/rt, the runtime it is validated on ({names})"


def test_a_namespaced_runtime_serves_only_its_namespace() -> None:
    rt = runtime("RLHFRuntime", namespace="team-a")
    job = on(kind="RLHFRuntime")
    job["metadata"]["namespace"] = "team-a"
    assert validate_on_runtime(job, rt) == []
    job["metadata"]["namespace"] = "team-b"
    [issue] = validate_on_runtime(job, rt)
    assert issue.path == "spec.runtimeRef" and "team-b" in issue.message


def test_the_merged_spec_is_checked_by_the_jobs_schema_and_rules() -> None:
    """The runtime's defaults make the job break a rule (gae needs a critic) and a schema bound."""
    rt = runtime(jobDefaults={"algorithm": {"advantageEstimator": "gae"}, "rollout": {"topP": 2}})
    assert validate_on_runtime(on(), rt) == [
        Issue(
            "spec.rollout.topP", "Input should be less than or equal to 1 (merged with ClusterRLHFRuntime/rt)"
        )
    ]
    rt = runtime(jobDefaults={"algorithm": {"advantageEstimator": "gae"}})
    [issue] = validate_on_runtime(on(), rt)
    assert issue.path == "spec.model.critic" and issue.message.endswith("(merged with ClusterRLHFRuntime/rt)")


def test_a_field_at_its_default_is_not_set() -> None:
    """runPolicy.backoffLimit 3 is the CRD's default: written so, the job leaves the runtime's value (no
    error, though the runtime keeps the field); 4 is set, and refused."""
    rt = runtime(jobDefaults={"runPolicy": {"backoffLimit": 1}}, overridable=["model", "data"])
    assert validate_on_runtime(on(runPolicy={"backoffLimit": 3}), rt) == []
    [issue] = validate_on_runtime(on(runPolicy={"backoffLimit": 4}), rt)
    assert issue.path == "spec.runPolicy.backoffLimit"


def test_the_job_is_merged_as_the_api_server_stores_it() -> None:
    """The API server prunes a null: `critic: null` leaves the runtime's critic, which gae needs."""
    model = {"actor": "/m/a", "critic": None, "reward": {"type": "function", "function": "r:f"}}
    rt = runtime(jobDefaults={"algorithm": {"advantageEstimator": "gae"}, "model": {"critic": "/m/c"}})
    assert validate_on_runtime(on(model=model), rt) == []


# ---- the command --------------------------------------------------------------------------------------


def test_cli_validates_the_runtime_then_each_job_on_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rt = write(tmp_path / "rt.yaml", runtime_manifest())
    good = write(tmp_path / "good.yaml", on())
    bad = write(tmp_path / "bad.yaml", on(image="mine:1"))
    assert cli_main(["validate", "--runtime", rt, good]) == 0
    assert capsys.readouterr().out.splitlines() == [f"{rt}: valid", f"{good}: valid"]
    assert cli_main(["validate", "--runtime", rt, good, bad]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[:2] == [f"{rt}: valid", f"{good}: valid"]
    assert lines[2].startswith(f"{bad}: spec.image: ClusterRLHFRuntime/rt does not let jobs set this field")


def test_cli_checks_no_job_on_an_invalid_runtime(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rt = write(tmp_path / "rt.yaml", runtime_manifest(storage={"modelCache": {"mountPath": "/m"}}))
    job = write(tmp_path / "job.yaml", on())
    assert cli_main(["validate", "--runtime", rt, job]) == 1
    captured = capsys.readouterr()
    assert captured.out.splitlines() == [
        f"{rt}: spec.storage.modelCache.claimName: the model cache is an existing claim (claimName) that jobs "
        "share; a claim per job (claimTemplate) would fetch every model again for each job"
    ]
    assert "no job was checked" in captured.err


def test_without_runtime_a_job_on_a_runtime_validates_its_own_fields(tmp_path: Path) -> None:
    assert validate_file(write(tmp_path / "job.yaml", on(pods={"priorityClassName": "mine"}))) == []
