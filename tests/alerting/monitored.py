"""What the alerting scenarios share: the chart values they render and install with, and the handles
a scenario gets (namespace, operator, Prometheus and Alertmanager, the webhook's deliveries).
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from typing import Any

from monitoring_stack import MonitoringStack, WebhookReceiver
from support import ROOT, OperatorProcess

sys.path.insert(0, str(ROOT / "tests" / "chart"))

from chart_tools import monitoring_args

RELEASE = "rlhf-operator"
METRICS_SERVICE = f"{RELEASE}-metrics"
# Test values: short `for`s and window so the group runs in minutes; everything else is the chart's.
FOR = "5s"
# Prometheus hands discovered targets to its scrapers at most every 5 s: absent(up) holds for the
# first ~5-6 s of a fresh server, so RLHFOperatorDown gets a longer `for` than that here.
OPERATOR_DOWN_FOR = "15s"
REWARD_ERRORS_WINDOW = "20s"
SCRAPE_INTERVAL_SECONDS = 1


def chart_values(operator_metrics_port: int, *, api: bool = True) -> list[str]:
    """`helm` arguments: with `api`, as rendered for a cluster with the Prometheus Operator's API."""
    alerts = "metrics.prometheusRule.alerts"
    return [
        *monitoring_args(api=api),
        "--set", f"operator.metricsPort={operator_metrics_port}",
        "--set", f"metrics.serviceMonitor.interval={SCRAPE_INTERVAL_SECONDS}s",
        "--set", f"metrics.serviceMonitor.scrapeTimeout={SCRAPE_INTERVAL_SECONDS}s",
        "--set", f"metrics.prometheusRule.rewardErrorsWindow={REWARD_ERRORS_WINDOW}",
        "--set", f"{alerts}.RLHFJobStepStalled.for={FOR}",
        "--set", f"{alerts}.RLHFJobPhaseStuck.for={FOR}",
        "--set", f"{alerts}.RLHFOperatorDown.for={OPERATOR_DOWN_FOR}",
    ]  # fmt: skip


@dataclass
class Monitored:
    """Everything a scenario needs: the namespace, the operator, the stack and what it delivered."""

    namespace: str
    operator: OperatorProcess
    stack: MonitoringStack
    webhook: WebhookReceiver
    rule: dict[str, Any]
    alert_names: set[str]

    def operator_up(self) -> float | None:
        res = self.stack.query(f'up{{job="{METRICS_SERVICE}", namespace="{self.namespace}"}}')
        return float(res[0]["value"][1]) if res else None


def seconds(duration: str) -> int:
    m = re.fullmatch(r"(\d+)([sm])", duration)
    assert m, duration
    return int(m.group(1)) * (60 if m.group(2) == "m" else 1)
