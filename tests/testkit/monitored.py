"""What the alerting scenarios share: the chart values they render and install with, and the handles
a scenario gets (namespace, operator, Prometheus and Alertmanager, the webhook's deliveries).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from testkit.chart_tools import monitoring_args
from testkit.monitoring_stack import (
    GROUP_INTERVAL_SECONDS,
    GROUP_WAIT_SECONDS,
    MonitoringStack,
    WebhookReceiver,
)
from testkit.support import OperatorProcess

RELEASE = "rlhf-operator"
METRICS_SERVICE = f"{RELEASE}-metrics"
# Test values: short `for`s and window so the group runs in minutes; everything else is the chart's.
FOR = "5s"
# Prometheus hands discovered targets to its scrapers at most every 5 s: absent(up) holds for the
# first ~5-6 s of a fresh server, so RLHFOperatorDown gets a longer `for` than that here.
OPERATOR_DOWN_FOR = "15s"
REWARD_ERRORS_WINDOW = "10s"  # ten scrapes: every ~3 s step's errors are in it (20 s cost 20 s more)
# The tiny job's weight sync is about 1 % of its step (0.03-0.04 s of ~3 s on this machine): 0.1 % makes
# every step "slow" so RLHFJobWeightSyncSlow fires for real; the chart's 0.2 never would here.
WEIGHT_SYNC_SHARE_THRESHOLD = 0.001
SCRAPE_INTERVAL_SECONDS = 1
EVALUATION_INTERVAL_SECONDS = 1  # Prometheus' evaluation_interval (start_stack)
RECONCILE_INTERVAL_SECONDS = 1  # the operator's RLHF_RECONCILE_INTERVAL (the fixture sets it)
# What the bounds below allow beyond the intervals: the three processes (Prometheus, Alertmanager, the
# operator) and the test's own polling scheduled late on a loaded 2-core machine, and one scrape that
# times out during `for` (a failed scrape marks the target's series stale, which sends a pending alert
# back to inactive: `for` + one evaluation again, 6 s here). Measured on 26 Nov, delivery minus the
# condition's start and `for`: 0.3-1.1 s, within the 2-3 s of intervals alone (docs/monitoring.md).
MARGIN_SECONDS = 10


def firing_bound(for_: str, seen_after: float = 0.0) -> float:
    """Seconds from the moment an alert's condition becomes true to the latest its firing notification
    may reach the webhook, derived from the configured intervals:

      seen_after            until Prometheus can see it: 0 for `time() - <timestamp> > <threshold>` over
                            series scraped long before (the stall alerts); one scrape interval for a new
                            value of a series; plus the operator's reconcile for a value it decides
      + evaluation          the first rule evaluation after that: the alert is pending
      + for + evaluation    the first evaluation at least `for` later: firing, sent to Alertmanager
      + group_wait          Alertmanager's first notification of a new group (every alert is its own)
      + MARGIN_SECONDS
    """
    return seen_after + 2 * EVALUATION_INTERVAL_SECONDS + seconds(for_) + GROUP_WAIT_SECONDS + MARGIN_SECONDS


def resolved_bound(seen_after: float) -> float:
    """Seconds from the moment an alert's condition ends to the latest its resolved notification may
    reach the webhook: `seen_after` (a scrape that fails or brings the new value, plus the operator's
    reconcile for a value it decides), the first evaluation after it (Prometheus sends the resolved
    alert at once), Alertmanager's next flush of the group (group_interval), and MARGIN_SECONDS."""
    return seen_after + EVALUATION_INTERVAL_SECONDS + GROUP_INTERVAL_SECONDS + MARGIN_SECONDS


def chart_values(operator_metrics_port: int, *, api: bool = True) -> list[str]:
    """`helm` arguments: with `api`, as rendered for a cluster with the Prometheus Operator's API."""
    alerts = "metrics.prometheusRule.alerts"
    return [
        *monitoring_args(api=api),
        "--set", f"operator.metricsPort={operator_metrics_port}",
        "--set", f"metrics.serviceMonitor.interval={SCRAPE_INTERVAL_SECONDS}s",
        "--set", f"metrics.serviceMonitor.scrapeTimeout={SCRAPE_INTERVAL_SECONDS}s",
        "--set", f"metrics.prometheusRule.rewardErrorsWindow={REWARD_ERRORS_WINDOW}",
        "--set", f"metrics.prometheusRule.weightSyncShareThreshold={WEIGHT_SYNC_SHARE_THRESHOLD}",
        "--set", f"{alerts}.RLHFJobStepStalled.for={FOR}",
        "--set", f"{alerts}.RLHFJobPhaseStuck.for={FOR}",
        "--set", f"{alerts}.RLHFJobWeightSyncSlow.for={FOR}",
        "--set", f"{alerts}.RLHFOperatorDown.for={OPERATOR_DOWN_FOR}",
        # No cpu-dev runtime: its name is cluster-wide, and the real-node test's release makes its own.
        "--set", "runtimes.cpuDev.enabled=false",
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
