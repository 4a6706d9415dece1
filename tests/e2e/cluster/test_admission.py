"""The generated CRD on a real API server: every invalid manifest is rejected naming the same field (and
rule message) as `rlhf validate`, valid ones are defaulted exactly as the pydantic model defaults them,
the engine range is create-only so `kubectl scale` can leave it, and the scale subresource, printer
columns and `kubectl explain` work.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from rlhf_api.rules import RULES
from rlhf_api.spec import RLHFJobSpec, RolloutSpec
from testkit.support import EXAMPLE_JOBS, INVALID_MANIFESTS, Cluster, wait_for
from testkit.support import manifest_header as header
from testkit.support import minimal_job as job

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[3]
INVALID, EXAMPLES = INVALID_MANIFESTS, EXAMPLE_JOBS
RULE_MESSAGES = {rule.name: rule.message for rule in RULES}


@pytest.fixture(scope="module")
def corpus_namespace(cluster: Cluster, rlhf_crd: str) -> Iterator[str]:
    """One namespace for the whole invalid corpus: nothing in it is ever created."""
    name = f"admission-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", name)
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.mark.parametrize("path", INVALID, ids=[p.stem for p in INVALID])
def test_api_server_rejects_invalid_manifest_naming_its_field(
    cluster: Cluster, corpus_namespace: str, path: Path
) -> None:
    expected = header(path)
    proc = cluster.kubectl("apply", "-n", corpus_namespace, "-f", "-", input=path.read_text(), check=False)
    assert proc.returncode != 0, f"{path.name} was accepted:\n{proc.stdout}"
    assert expected["expect"] in proc.stderr, proc.stderr
    if "rule" in expected:
        assert RULE_MESSAGES[expected["rule"]] in proc.stderr, proc.stderr


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_examples_are_admitted_and_defaulted_like_the_model(
    cluster: Cluster, rlhf_crd: str, namespace: str, path: Path
) -> None:
    proc = cluster.kubectl("create", "-n", namespace, "--dry-run=server", "-o", "json", "-f", str(path))
    by_server = json.loads(proc.stdout)["spec"]
    manifest = yaml.safe_load(path.read_text())
    by_model = RLHFJobSpec.model_validate(manifest["spec"]).model_dump(
        by_alias=True, exclude_none=True, mode="json"
    )
    assert by_server == by_model


def test_minimal_job_is_defaulted_like_the_model(cluster: Cluster, rlhf_crd: str, namespace: str) -> None:
    manifest = job("minimal")
    cluster.apply(manifest, namespace)
    stored = cluster.get("rlhfjob", "minimal", namespace)
    assert stored is not None
    expected = RLHFJobSpec.model_validate(manifest["spec"]).model_dump(
        by_alias=True, exclude_none=True, mode="json"
    )
    assert stored["spec"] == expected
    assert stored["spec"]["rollout"]["autoscaling"]["maxEngines"] == 8


def test_scale_outside_the_autoscaling_range_is_accepted_after_create(
    cluster: Cluster, rlhf_crd: str, namespace: str
) -> None:
    """The range rule is create-only: scale requests outside it go through, and the operator clamps them."""
    autoscaling = {"enabled": True, "minEngines": 1, "maxEngines": 2}
    cluster.apply(job("scaled", rollout={"engines": 2, "autoscaling": autoscaling}), namespace)
    cluster.kubectl("scale", "-n", namespace, "rlhfjob/scaled", "--replicas=5")
    stored = cluster.get("rlhfjob", "scaled", namespace)
    assert stored is not None and stored["spec"]["rollout"]["engines"] == 5
    # Later updates of other fields are not blocked by the out-of-range engine count either.
    cluster.kubectl(
        "patch",
        "-n",
        namespace,
        "rlhfjob/scaled",
        "--type=merge",
        "-p",
        '{"spec":{"runPolicy":{"backoffLimit":7}}}',
    )
    stored = cluster.get("rlhfjob", "scaled", namespace)
    assert stored is not None and stored["spec"]["runPolicy"]["backoffLimit"] == 7
    # Schema bounds still hold on updates.
    proc = cluster.kubectl("scale", "-n", namespace, "rlhfjob/scaled", "--replicas=0", check=False)
    assert proc.returncode != 0 and "spec.rollout.engines" in proc.stderr


def test_scale_subresource_and_printer_columns_follow_status(
    cluster: Cluster, rlhf_crd: str, namespace: str
) -> None:
    cluster.apply(job("printed", rollout={"engines": 3}), namespace)
    status = {
        "phase": "Running",
        "step": 3,
        "totalSteps": 10,
        "progress": "3/10",
        "generationShare": 0.42,
        "rewardMean": 0.5,
        "evalRewardMean": 0.25,
        "sampleStaleness": 1.0,
        "trainerIdleRatio": 0.08,
        "rolloutIdleRatio": 0.3,
        "rollout": {
            "desiredEngines": 3,
            "readyEngines": 2,
            "selector": "ray.io/cluster=printed,ray.io/group=rollout",
        },
    }
    cluster.kubectl(
        "patch",
        "-n",
        namespace,
        "rlhfjob/printed",
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps({"status": status}),
    )
    scale = json.loads(
        cluster.kubectl(
            "get", "--raw", f"/apis/rlhf.dev/v1alpha1/namespaces/{namespace}/rlhfjobs/printed/scale"
        ).stdout
    )
    assert scale["spec"]["replicas"] == 3
    assert scale["status"]["replicas"] == 2
    assert scale["status"]["selector"] == "ray.io/cluster=printed,ray.io/group=rollout"

    header_line, row = cluster.kubectl("get", "rlhf", "-n", namespace, "printed").stdout.splitlines()
    assert header_line.split() == ["NAME", "PHASE", "STEP", "GENSHARE", "ENGINES", "AGE"]
    assert row.split()[:5] == ["printed", "Running", "3/10", "0.42", "2"]
    wide_header, wide_row = cluster.kubectl("get", "rlhf", "-n", namespace, "-o", "wide").stdout.splitlines()
    columns = wide_header.split()
    assert columns[5:12] == [
        "REWARD", "EVALREWARD", "STALENESS", "TRAINERIDLE", "ROLLOUTIDLE", "DESIRED", "TRACKING"
    ], columns  # fmt: skip
    # the reward, the evaluation split's reward, async RL's staleness and both idle ratios, and the
    # engines asked for
    assert wide_row.split()[5:11] == ["0.5", "0.25", "1", "0.08", "0.3", "3"], wide_row


def test_status_schema_is_enforced(cluster: Cluster, rlhf_crd: str, namespace: str) -> None:
    cluster.apply(job("status-check"), namespace)
    proc = cluster.kubectl(
        "patch",
        "-n",
        namespace,
        "rlhfjob/status-check",
        "--subresource=status",
        "--type=merge",
        "-p",
        '{"status":{"phase":"Exploded"}}',
        check=False,
    )
    assert proc.returncode != 0 and "status.phase" in proc.stderr


def test_kubectl_explain_shows_the_model_descriptions(cluster: Cluster, rlhf_crd: str) -> None:
    def explained() -> str | None:
        proc = cluster.kubectl("explain", "rlhfjob.spec.rollout.gpusPerWorker", check=False)
        return proc.stdout if proc.returncode == 0 else None

    text = wait_for(explained, 60, "kubectl explain to see the RLHFJob schema")
    description = RolloutSpec.model_fields["gpus_per_worker"].description
    assert description
    assert " ".join(description.split()[:8]) in " ".join(text.split())  # explain wraps long lines
