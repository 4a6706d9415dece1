"""RLHFOperatorDown for real: the operator, scraped through the chart's ServiceMonitor by a real
Prometheus, is SIGKILLed and not restarted; Alertmanager must deliver the alert to the test's webhook,
then the resolved notification once the operator is back. Needs no trainer and no Ray.
"""

from __future__ import annotations

import time

import pytest
from testkit.monitored import (
    METRICS_SERVICE,
    OPERATOR_DOWN_FOR,
    SCRAPE_INTERVAL_SECONDS,
    Monitored,
    firing_bound,
)
from testkit.support import wait_for

pytestmark = pytest.mark.alerting


def test_operator_killed_fires_operator_down_and_resolves_when_it_is_back(monitored: Monitored) -> None:
    m, ns = monitored, monitored.namespace
    labels = {"alertname": "RLHFOperatorDown", "namespace": ns, "job": METRICS_SERVICE}
    assert not m.webhook.alerts(**labels)
    m.operator.kill()
    t_kill = time.time()
    fired = wait_for(lambda: m.webhook.alerts("firing", **labels), 120, "RLHFOperatorDown delivered")
    assert fired[0][1]["annotations"]["runbook_url"].endswith("docs/monitoring.md#rlhfoperatordown")
    m.operator.start()
    t_back = time.time()
    resolved = wait_for(lambda: m.webhook.alerts("resolved", **labels), 120, "RLHFOperatorDown resolved")
    # The first scrape after the kill fails (up == 0): one scrape interval, then the derivation of
    # firing_bound (evaluation, `for`, evaluation, group_wait, margin).
    bound = firing_bound(OPERATOR_DOWN_FOR, seen_after=SCRAPE_INTERVAL_SECONDS)
    print(f"operator down: delivered {fired[0][0] - t_kill:.1f} s after the kill (for {OPERATOR_DOWN_FOR}, "
          f"bound {bound:.0f} s); resolved {resolved[0][0] - t_back:.1f} s after the restart")  # fmt: skip
    assert fired[0][0] - t_kill <= bound, (fired[0][0] - t_kill, bound)
