"""rlhf_operator.config: the operator's environment parsed once into a frozen OperatorConfig; every variable
the Helm chart sets still maps to something the operator reads."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest
from rlhf_api import constants
from rlhf_operator import security
from rlhf_operator.config import ConfigError, OperatorConfig, from_env

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
# Set by the chart and read outside config.py, on purpose (config.py's docstring says where).
READ_ELSEWHERE = {"POD_NAME", "RLHF_LOG_FORMAT", "RLHF_LEADER_ELECTION", "RLHF_RAY_TOKEN_KEY_FILE"}


def test_defaults() -> None:
    cfg = from_env({})
    assert cfg == OperatorConfig()
    assert cfg.reconcile_interval == 2.0 and cfg.unseen_write_grace == 15.0
    assert (cfg.handler_threads, cfg.api_connections, cfg.worker_idle_seconds) == (20, 64, 0.5)
    assert (cfg.remote_concurrency, cfg.remote_per_host) == (8, 2)
    assert (cfg.metrics_port, cfg.metrics_addr) == (8000, "127.0.0.1")
    assert (cfg.dev_head_host, cfg.dev_dashboard_port, cfg.gpu_standin) == ("", security.DASHBOARD_PORT, "")
    assert cfg.default_trainer_image == constants.DEFAULT_TRAINER_IMAGE
    assert cfg.policy_access == security.policy_access_from_env({})


@pytest.mark.parametrize("interval", [0.5, 2.0, 30.0, 120.0])
def test_a_heads_connections_outlive_the_gap_between_two_rounds(interval: float) -> None:
    """Kept past the next round (with room for a late one), so the round reuses them."""
    assert from_env({"RLHF_RECONCILE_INTERVAL": str(interval)}).head_keepalive >= 2 * interval + 5


def test_blank_is_the_default() -> None:
    assert from_env({"RLHF_HANDLER_THREADS": "", "RLHF_DEFAULT_TRAINER_IMAGE": "  "}) == OperatorConfig()


def test_every_variable_parsed() -> None:
    cfg = from_env(
        {
            "RLHF_RECONCILE_INTERVAL": "30",
            "RLHF_DEV_HEAD_HOST": "127.0.0.1",
            "RLHF_DEV_DASHBOARD_PORT": "18265",
            "RLHF_GPU_STANDIN": " cpu-gpu ",
            "RLHF_DEFAULT_TRAINER_IMAGE": "trainer:1",
            "POD_NAMESPACE": "ops",
            "RLHF_OPERATOR_POD_LABELS": '{"app": "op"}',
            "RLHF_METRICS_FROM": '[{"podSelector": {}}]',
            "RLHF_HANDLER_THREADS": "40",
            "RLHF_API_CONNECTIONS": "3",
            "RLHF_WORKER_IDLE_SECONDS": "5",
            "RLHF_REMOTE_CONCURRENCY": "16",
            "RLHF_REMOTE_PER_HOST": "8",
            "RLHF_OPERATOR_METRICS_PORT": "0",
            "RLHF_OPERATOR_METRICS_ADDR": "0.0.0.0",
        }
    )
    assert cfg.reconcile_interval == 30.0 and cfg.unseen_write_grace == 150.0
    assert (cfg.dev_head_host, cfg.dev_dashboard_port) == ("127.0.0.1", 18265)
    assert (cfg.gpu_standin, cfg.default_trainer_image) == ("cpu-gpu", "trainer:1")
    assert cfg.policy_access == security.PolicyAccess("ops", {"app": "op"}, ({"podSelector": {}},))
    assert cfg.api_connections == 8, "at least one connection for each watch"
    assert (cfg.handler_threads, cfg.worker_idle_seconds) == (40, 5.0)
    assert (cfg.remote_concurrency, cfg.remote_per_host) == (16, 8)
    assert (cfg.metrics_port, cfg.metrics_addr) == (0, "0.0.0.0")


@pytest.mark.parametrize(
    ("name", "value", "says"),
    [
        ("RLHF_HANDLER_THREADS", "twenty", "RLHF_HANDLER_THREADS='twenty' is not an integer"),
        ("RLHF_RECONCILE_INTERVAL", "2s", "RLHF_RECONCILE_INTERVAL='2s' is not a number"),
        ("RLHF_RECONCILE_INTERVAL", "0", "RLHF_RECONCILE_INTERVAL='0' must be at least"),
        ("RLHF_REMOTE_PER_HOST", "0", "RLHF_REMOTE_PER_HOST='0' must be at least 1"),
        ("RLHF_OPERATOR_METRICS_PORT", "-1", "RLHF_OPERATOR_METRICS_PORT='-1' must be at least 0"),
        ("RLHF_METRICS_FROM", "[{", "RLHF_METRICS_FROM is not JSON"),
        ("RLHF_OPERATOR_POD_LABELS", '{"a": 1}', "RLHF_OPERATOR_POD_LABELS must be a JSON object of strings"),
    ],
)
def test_a_bad_value_names_its_variable(name: str, value: str, says: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(says)):
        from_env({name: value})


def test_the_configuration_is_frozen() -> None:
    cfg = from_env({})
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.handler_threads = 1  # type: ignore[misc]


class _Recorder(dict[str, str]):
    """An environment that records the names read from it."""

    def __init__(self) -> None:
        super().__init__()
        self.read: set[str] = set()

    def get(self, key: str, default: Any = None) -> Any:
        self.read.add(key)
        return super().get(key, default)


def test_every_variable_the_chart_sets_is_read() -> None:
    templates = (ROOT / "charts" / "rlhf-operator" / "templates").glob("*.yaml")
    chart = {m for t in templates for m in re.findall(r"name: ((?:RLHF|POD)_[A-Z_]+)", t.read_text())}
    assert "RLHF_RECONCILE_INTERVAL" in chart, chart
    env = _Recorder()
    from_env(env)
    assert chart - env.read - READ_ELSEWHERE == set()
