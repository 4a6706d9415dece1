"""`rlhf run` front door (rlhf_trainer.cli): --set overrides and the per-step phase table."""

from __future__ import annotations

import pytest
from rlhf_trainer import cli
from rlhf_trainer.loop import StepReport
from rlhf_trainer.metrics import PHASES

pytestmark = pytest.mark.unit


def test_overrides_are_relative_to_spec_and_parsed_as_yaml() -> None:
    m = {"metadata": {"name": "a"}, "spec": {"algorithm": {"totalSteps": 20}, "model": {"critic": "/m"}}}
    out = cli.apply_overrides(m, ["algorithm.totalSteps=3", "model.critic=null", "metadata.name=b",
                                  "spec.rollout.temperature=0.7", "data.prompts=/p/x.jsonl"])  # fmt: skip
    assert out["spec"]["algorithm"]["totalSteps"] == 3 and out["spec"]["model"]["critic"] is None
    assert out["metadata"]["name"] == "b" and out["spec"]["rollout"]["temperature"] == 0.7
    assert out["spec"]["data"]["prompts"] == "/p/x.jsonl"
    assert cli.apply_overrides(out, ["model.critic.x=1"])["spec"]["model"]["critic"] == {
        "x": 1
    }  # null -> mapping


@pytest.mark.parametrize(
    "item, needle",
    [("algorithm.totalSteps", "expected path.to.field=value"), ("model.reward.function=[x]/r.py:f", "not valid YAML"),
     ("algorithm.totalSteps.x=1", "spec.algorithm.totalSteps is 20, not a mapping")],
)  # fmt: skip
def test_bad_overrides_name_the_field(item: str, needle: str) -> None:
    with pytest.raises(ValueError, match=needle) as e:
        cli.apply_overrides({"spec": {"algorithm": {"totalSteps": 20}}}, [item])
    assert item.partition("=")[0] in str(e.value)


def test_step_table_has_a_column_per_phase_aligned_with_its_header() -> None:
    assert list(cli._PHASE_COLUMNS) == list(PHASES)
    r = StepReport(step=3, phase_seconds={"generation": 1.25, "weight_sync": 0.05}, reward_mean=0.41, kl=0.01,
                   generated_tokens=10, trained_tokens=10, reward_errors=0, valid_samples=8,
                   tokens_per_second=8.0, step_seconds=1.4)  # fmt: skip
    header, row = cli._step_header(), cli._step_row(r)
    assert len(header) == len(row)
    cols = header.split("|")[1].split()
    cells = row.split("|")[1].split()
    assert dict(zip(cols, cells, strict=True)) == {
        "gen": "1.25", "reward": "-", "ref": "-", "values": "-", "oldlp": "-", "adv": "-", "actor": "-",
        "critic": "-", "sync": "0.05", "ckpt": "-", "eval": "-", "tool": "-", "total": "1.40",  # the step's wall time
    }  # fmt: skip
