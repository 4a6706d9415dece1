"""Offline validation: every invalid manifest under tests/data/invalid is rejected naming its field
(the same files go to a real API server in tests/e2e/cluster/test_admission.py), the examples are valid,
and `rlhf validate` prints and exits as documented without importing heavy packages."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from rlhf_api import pod_settings
from rlhf_api.rules import RULES
from rlhf_api.runtime_merge import merge, with_crd_defaults
from rlhf_api.spec import RLHFJob, RLHFJobSpec
from rlhf_api.validate import (
    Issue,
    load_runtime,
    runtime_issues,
    validate_file,
    validate_manifest,
    validate_text,
)
from rlhf_cli.main import main as cli_main
from testkit.support import EXAMPLE_JOBS, EXAMPLE_RUNTIMES, INVALID_MANIFESTS, example_runtime
from testkit.support import manifest_header as header

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
INVALID, EXAMPLES = INVALID_MANIFESTS, EXAMPLE_JOBS
ON_RUNTIME = [path for path in EXAMPLES if example_runtime(path)]
RULES_BY_NAME = {rule.name: rule for rule in RULES}


def load_job(path: Path) -> RLHFJob:
    """The one RLHFJob of a manifest file that validates (the examples)."""
    (document,) = [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
    assert validate_manifest(document) == [], path
    return RLHFJob.model_validate(document, by_alias=True, by_name=False)


def valid_manifest() -> dict[str, Any]:
    return {
        "apiVersion": "rlhf.dev/v1alpha1",
        "kind": "RLHFJob",
        "metadata": {"name": "ok"},
        "spec": {
            "model": {"actor": "/m", "reward": {"type": "function", "function": "r:f"}},
            "data": {"prompts": "/p.jsonl"},
        },
    }


# ---- the invalid corpus ------------------------------------------------------------------------


def test_corpus_is_large_and_made_of_full_manifests() -> None:
    assert len(INVALID) >= 30
    names = set()
    for path in INVALID:
        assert path.read_text().startswith("# expect: spec."), path.name
        obj = yaml.safe_load(path.read_text())
        assert obj["apiVersion"] == "rlhf.dev/v1alpha1" and obj["kind"] == "RLHFJob", path.name
        names.add(obj["metadata"]["name"])
    assert len(names) == len(INVALID), "metadata.name must be unique across the corpus"


def test_corpus_covers_every_cross_field_rule() -> None:
    covered = {header(path).get("rule") for path in INVALID}
    assert set(RULES_BY_NAME) <= covered, sorted(set(RULES_BY_NAME) - covered)


@pytest.mark.parametrize("path", INVALID, ids=[p.stem for p in INVALID])
def test_invalid_manifest_is_rejected_naming_its_field(path: Path) -> None:
    expected = header(path)
    issues = validate_file(path)
    assert [issue.path for issue in issues] == [expected["expect"]], issues
    if "rule" in expected:
        assert issues[0].message == RULES_BY_NAME[expected["rule"]].message


# ---- valid manifests ---------------------------------------------------------------------------


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_examples_are_valid(path: Path) -> None:
    assert validate_file(path) == []
    job = load_job(path)
    assert isinstance(job, RLHFJob) and job.name


def test_expected_examples_exist() -> None:
    assert {p.name for p in EXAMPLES} >= {
        "rlhfjob-tiny.yaml",
        "rlhfjob-grpo.yaml",
        "rlhfjob-llama-8b.yaml",
        "rlhfjob-tiny-s3-tracked.yaml",  # s3:// model and data, evaluation, MLflow, exportTo (issue 34)
        "rlhfjob-agent-calculator.yaml",
        "rlhfjob-agent-code-exec.yaml",
    }


@pytest.mark.parametrize("name", ["rlhfjob-agent-calculator.yaml", "rlhfjob-agent-code-exec.yaml"])
def test_the_agent_examples_name_their_agent_function_and_it_loads(name: str) -> None:
    """Both agent examples set rollout.agent, and the function it names (a file under examples/agents, or a
    module of that folder as the code-exec job's PYTHONPATH makes it) loads as an agent function. Through
    `rlhf validate` as a user checks them; the calculator job runs in tests/e2e/ray/test_agent_examples.py."""
    from rlhf_trainer.agents.contract import load_agent_function

    path = ROOT / "examples" / name
    assert cli_main(["validate", str(path)]) == 0
    agent = load_job(path).spec.rollout.agent
    assert agent is not None
    target, _, fn = agent.function.rpartition(":")
    if not target.endswith(".py"):  # a module on the job's PYTHONPATH: examples/agents copied there
        target = str(ROOT / "examples" / "agents" / f"{target.replace('.', '/')}.py")
    else:
        target = str(ROOT / target)
    assert fn == "run_episode"
    load_agent_function(f"{target}:{fn}")


@pytest.mark.runtime
@pytest.mark.parametrize("path", EXAMPLE_RUNTIMES, ids=[p.stem for p in EXAMPLE_RUNTIMES])
def test_runtime_examples_are_valid_and_run_a_job_example(path: Path) -> None:
    runtime, issues = load_runtime(path)
    assert issues == [] and runtime is not None and f"{runtime.name}.yaml" == path.name
    assert path in map(example_runtime, EXAMPLES), f"no job example names {path.stem}"


@pytest.mark.runtime
@pytest.mark.parametrize("path", ON_RUNTIME, ids=[p.stem for p in ON_RUNTIME])
def test_examples_on_a_runtime_are_valid_on_it(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Through `rlhf validate --runtime`, as a user checks them."""
    runtime = example_runtime(path)
    assert cli_main(["validate", "--runtime", str(runtime), str(path)]) == 0, capsys.readouterr().out


def test_expected_runtime_examples_exist() -> None:
    assert {p.name for p in EXAMPLE_RUNTIMES} >= {"cpu-dev.yaml", "h100-ib.yaml"}
    assert {p.name for p in ON_RUNTIME} >= {
        "rlhfjob-tiny-on-runtime.yaml",
        "rlhfjob-llama-8b-on-runtime.yaml",
    }


def on_its_runtime(path: Path) -> RLHFJobSpec:
    """A job example merged over the runtime example it names, as the operator merges it."""
    runtime, _ = load_runtime(example_runtime(path) or "")
    assert runtime is not None
    doc = yaml.safe_load(path.read_text())
    stored = with_crd_defaults(doc["spec"])
    return RLHFJobSpec.model_validate(
        merge(stored, runtime.spec, "runtime", doc["metadata"]["name"], "team-a").spec
    )


@pytest.mark.runtime
@pytest.mark.parametrize(
    ("on_runtime", "alone"),
    [
        ("rlhfjob-tiny-on-runtime.yaml", "rlhfjob-tiny.yaml"),
        ("rlhfjob-llama-8b-on-runtime.yaml", "rlhfjob-llama-8b.yaml"),
    ],
)
def test_an_example_on_a_runtime_runs_its_twins_experiment(on_runtime: str, alone: str) -> None:
    merged = on_its_runtime(ROOT / "examples" / on_runtime)
    spec = load_job(ROOT / "examples" / alone).spec
    for section in ("algorithm", "trainer", "rollout", "weight_sync", "monitoring"):
        assert getattr(merged, section) == getattr(spec, section), section
    name = yaml.safe_load((ROOT / "examples" / on_runtime).read_text())["metadata"]["name"]
    assert merged.checkpoint.path == f"/checkpoints/team-a/{name}"  # on the runtime's checkpoint claim


@pytest.mark.runtime
def test_the_8b_example_on_h100_ib_gets_the_8b_examples_pods() -> None:
    merged = on_its_runtime(ROOT / "examples" / "rlhfjob-llama-8b-on-runtime.yaml")
    spec = load_job(ROOT / "examples" / "rlhfjob-llama-8b.yaml").spec
    assert merged.image and merged.image.endswith("rlhf-trainer:0.1.0")  # the GPU flavour
    for role in pod_settings.POD_ROLES:
        mine, theirs = pod_settings.for_role(merged.pods, role), pod_settings.for_role(spec.pods, role)
        for field in ("node_selector", "tolerations", "priority_class_name", "annotations", "env_from"):
            assert getattr(mine, field) == getattr(theirs, field), (role, field)
        assert (mine.resources and mine.resources.requests) == (
            theirs.resources and theirs.resources.requests
        )
        mounts = {m["mountPath"] for m in mine.volume_mounts or []}
        assert mounts == {m["mountPath"] for m in theirs.volume_mounts or []}, role


def test_tiny_example_is_a_small_cpu_gae_run() -> None:
    spec = load_job(ROOT / "examples" / "rlhfjob-tiny.yaml").spec
    assert spec.algorithm.advantage_estimator == "gae" and spec.model.critic
    assert spec.trainer.actor.ranks == 2
    assert spec.rollout.engines == 1
    assert spec.trainer.bf16 is False


def test_8b_example_geometry() -> None:
    spec = load_job(ROOT / "examples" / "rlhfjob-llama-8b.yaml").spec
    assert (spec.trainer.actor.nodes, spec.trainer.actor.gpus_per_node) == (2, 8)
    assert (spec.rollout.engines, spec.rollout.tensor_parallel_size) == (4, 2)
    assert spec.trainer.zero_stage == 3
    assert spec.checkpoint.path and spec.checkpoint.path.startswith("/checkpoints")
    mounts = {m["mountPath"] for m in spec.pods.volume_mounts or []}
    assert "/checkpoints" in mounts


# ---- paths and messages ------------------------------------------------------------------------


def test_paths_follow_list_indexes_and_drop_union_tags() -> None:
    manifest = valid_manifest()
    manifest["spec"]["pods"] = {
        "imagePullSecrets": [{"name": "a"}, {"nam": "b"}],
        "head": {"resources": {"requests": {"cpu": 0.5}}},
    }
    paths = {issue.path for issue in validate_manifest(manifest)}
    assert paths == {
        "spec.pods.imagePullSecrets[1].nam",
        "spec.pods.imagePullSecrets[1].name",
        "spec.pods.head.resources.requests.cpu",
    }


def test_union_failures_are_one_issue() -> None:
    manifest = valid_manifest()
    manifest["spec"]["pods"] = {"resources": {"limits": {"memory": [1]}}}
    [issue] = validate_manifest(manifest)
    assert issue.path == "spec.pods.resources.limits.memory"
    assert "integer" in issue.message and "string" in issue.message


def test_top_level_problems() -> None:
    manifest = valid_manifest()
    manifest["apiVersion"] = "rlhf.dev/v1"
    manifest["metadata"] = {"name": "Not_Valid"}
    manifest["specs"] = {}
    paths = [issue.path for issue in validate_manifest(manifest)]
    assert paths == ["apiVersion", "metadata.name", "specs"]
    assert [i.path for i in validate_manifest({"apiVersion": "rlhf.dev/v1alpha1", "kind": "RLHFJob"})] == [
        "metadata",
        "spec",
    ]
    assert validate_manifest(["not", "a", "mapping"])[0].path == ""


def test_generate_name_is_enough_and_status_is_ignored() -> None:
    manifest = valid_manifest()
    manifest["metadata"] = {"generateName": "run-"}
    manifest["status"] = {"phase": "NotAPhase"}
    assert validate_manifest(manifest) == []


def test_rules_still_run_when_only_metadata_is_wrong() -> None:
    manifest = valid_manifest()
    manifest["metadata"] = {}
    manifest["spec"]["algorithm"] = {"advantageEstimator": "gae"}
    assert [i.path for i in validate_manifest(manifest)] == ["metadata.name", "spec.model.critic"]


def test_malformed_yaml_is_one_issue_with_the_line() -> None:
    issues = validate_text("apiVersion: rlhf.dev/v1alpha1\nkind: RLHFJob\nspec:\n  model: [unclosed\n")
    assert len(issues) == 1
    assert issues[0].path.startswith("line ")
    assert int(issues[0].path.split()[1]) >= 4
    assert "malformed YAML" in issues[0].message


def test_multiple_documents_are_each_validated() -> None:
    good = yaml.safe_dump(valid_manifest())
    bad_manifest = valid_manifest()
    bad_manifest["spec"]["rollout"] = {"engines": 0}
    issues = validate_text(good + "---\n" + yaml.safe_dump(bad_manifest))
    assert [str(issue.path) for issue in issues] == ["[doc 2] spec.rollout.engines"]


def test_empty_file_is_an_issue() -> None:
    assert validate_text("# nothing\n") == [Issue("", "no YAML document found")]


# ---- the CLI -----------------------------------------------------------------------------------


def test_cli_validate_prints_one_line_per_issue_and_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    bad = ROOT / "tests" / "data" / "invalid" / "01-engines-zero.yaml"
    good = ROOT / "examples" / "rlhfjob-tiny.yaml"
    assert cli_main(["validate", str(good), str(bad)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        f"{good}: valid",
        f"{bad}: spec.rollout.engines: Input should be greater than or equal to 1",
    ]


def test_cli_validate_exits_0_when_all_valid(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["validate", *map(str, EXAMPLES)]) == 0
    assert all(line.endswith(": valid") for line in capsys.readouterr().out.splitlines())


def test_cli_validate_reports_malformed_yaml_with_file_and_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("kind: RLHFJob\nspec:\n  model: {actor: /a\n  data: x\n")
    assert cli_main(["validate", str(path)]) == 1
    [line] = capsys.readouterr().out.splitlines()
    assert line.startswith(f"{path}: line ") and "malformed YAML" in line


def test_cli_validate_does_not_import_heavy_packages() -> None:
    code = (
        "import sys\n"
        "from rlhf_cli.main import main\n"
        f"rc = main(['validate', {str(EXAMPLES[0])!r}])\n"
        "heavy = sorted(m for m in ('kopf', 'kubernetes', 'torch', 'ray', 'vllm', 'rlhf_trainer', 'rlhf_operator') if m in sys.modules)\n"
        "print('HEAVY', heavy)\n"
        "sys.exit(rc)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "HEAVY []" in proc.stdout


# ---- runtime_issues: the checks that need the files a spec names ---------------------------------


def hf_dir(path: Path, heads: int = 2, **files: str) -> str:
    """A directory that looks like an HF model to the checks (config.json with head counts, plus files)."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(f'{{"num_attention_heads": {heads}, "num_key_value_heads": {heads}}}')
    for name, text in files.items():
        (path / name).write_text(text)
    return str(path)


def _job_spec(**sections: Any) -> RLHFJobSpec:
    spec = valid_manifest()["spec"]
    spec.update(sections)
    return RLHFJobSpec.model_validate(spec, by_alias=True, by_name=False)


def test_runtime_issues_name_each_missing_or_non_hf_model(tmp_path: Path) -> None:
    not_hf = tmp_path / "not-hf"
    not_hf.mkdir()
    model = {
        "actor": str(tmp_path / "nowhere"),
        "critic": str(not_hf),
        "reward": {"type": "model", "model": hf_dir(tmp_path / "rm")},
    }
    issues = runtime_issues(_job_spec(model=model, algorithm={"advantageEstimator": "gae"}))
    assert issues == [
        Issue("spec.model.actor", f"model directory {tmp_path / 'nowhere'} does not exist"),
        Issue("spec.model.critic", f"{not_hf} is not an HF model directory (no config.json)"),
    ]
    # The critic is not loaded under grpo, and the reference defaults to the actor.
    model["actor"] = hf_dir(tmp_path / "actor")
    assert runtime_issues(_job_spec(model=model)) == []
    model["reference"] = str(tmp_path / "gone")
    assert runtime_issues(_job_spec(model=model)) == [
        Issue("spec.model.reference", f"model directory {tmp_path / 'gone'} does not exist")
    ]
    assert runtime_issues(_job_spec(model=model, algorithm={"klCoef": 0})) == []  # no reference loaded


def test_runtime_issues_check_the_heads_sequence_parallelism_splits(tmp_path: Path) -> None:
    model = {"actor": hf_dir(tmp_path / "a", heads=2), "reward": {"type": "function", "function": "r:f"}}
    trainer = {"actor": {"gpusPerNode": 4}, "sequenceParallelSize": 4}
    issues = runtime_issues(_job_spec(model=model, trainer=trainer, algorithm={"klCoef": 0}))
    assert [(i.path, i.message.split(" (")[0]) for i in issues] == [
        ("spec.trainer.sequenceParallelSize", "4 must divide the attention heads of spec.model.actor")
    ]


def test_runtime_issues_need_a_chat_template_only_when_asked(tmp_path: Path) -> None:
    plain = {"actor": hf_dir(tmp_path / "plain"), "reward": {"type": "function", "function": "r:f"}}
    chat = {"prompts": "/p.jsonl", "applyChatTemplate": True}
    assert runtime_issues(_job_spec(model=plain)) == []
    assert runtime_issues(_job_spec(model=plain, data=chat)) == [
        Issue("spec.data.applyChatTemplate", f"the actor's tokenizer ({plain['actor']}) has no chat template")
    ]
    for name, files in {
        "jinja": {"chat_template.jinja": "{{ messages }}"},
        "config": {"tokenizer_config.json": '{"chat_template": "{{ messages }}"}'},
    }.items():
        model = {**plain, "actor": hf_dir(tmp_path / name, **files)}
        assert runtime_issues(_job_spec(model=model, data=chat)) == [], name
