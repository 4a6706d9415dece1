"""docs/gpu-cluster.md shows the RayCluster the operator renders for the 8B example: keep it true."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from rlhf_api.spec import RLHFJob
from rlhf_operator import manifests

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
IMAGE = "registry.example.com/ml/rlhf-trainer:0.1.0"


def test_the_guide_shows_what_the_operator_renders_for_the_8b_example() -> None:
    text = (ROOT / "docs" / "gpu-cluster.md").read_text()
    block = re.search(r"<!-- BEGIN rendered RayCluster -->\n```yaml\n(.*?)```\n<!-- END", text, re.S)
    assert block, "docs/gpu-cluster.md lost its rendered RayCluster block"
    doc = yaml.safe_load((ROOT / "examples" / "rlhfjob-llama-8b.yaml").read_text())
    doc["metadata"]["namespace"] = "team-a"
    rendered = manifests.build_raycluster(RLHFJob.model_validate(doc), default_image=IMAGE)
    assert yaml.safe_load(block.group(1)) == rendered, "re-render the block (see the test for how)"
