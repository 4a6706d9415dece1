"""Fixtures of the alerting group: the chart installed in the test's namespace (its operator pod a KWOK
fake, so its metrics Service has endpoints to discover), the real operator as a host process serving
its metrics on the chart's metrics port, and Prometheus + Alertmanager configured from `helm template`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from testkit.chart_tools import CHART, one, render
from testkit.monitored import (
    EVALUATION_INTERVAL_SECONDS,
    RECONCILE_INTERVAL_SECONDS,
    RELEASE,
    Monitored,
    chart_values,
)
from testkit.monitoring_stack import MonitoringStack, WebhookReceiver, start_stack
from testkit.support import Cluster, OperatorProcess, free_port, wait_for


def _serves(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture
def monitored(cluster: Cluster, namespace: str, rlhf_crd: str, tmp_path: Path) -> Iterator[Monitored]:
    port = free_port()
    # Installed without the monitoring API (this cluster has no Prometheus Operator): the Service and
    # the operator's Deployment; the monitors and the rule are read from `helm template` instead.
    install = chart_values(port, api=False)
    cluster.helm("install", RELEASE, str(CHART), "-n", namespace, "--wait", "--timeout", "120s", *install)
    webhook: WebhookReceiver | None = None
    stack: MonitoringStack | None = None
    # The reconcile interval named here, not left to OperatorProcess' default: the delivery bounds of
    # the operator's alerts are derived from it (monitored.py).
    op_env = {
        "RLHF_OPERATOR_METRICS_PORT": str(port),
        "RLHF_RECONCILE_INTERVAL": str(RECONCILE_INTERVAL_SECONDS),
    }
    op = OperatorProcess(cluster, tmp_path / "operator.log", op_env)
    try:
        objects = render(*chart_values(port), namespace=namespace)
        monitors = [o for o in objects if o["kind"] in ("ServiceMonitor", "PodMonitor")]
        assert {o["kind"] for o in monitors} == {"ServiceMonitor", "PodMonitor"}, monitors
        rule = one(objects, "PrometheusRule")
        op.start()
        # Serving before Prometheus starts: else RLHFOperatorDown (absent up) fires during start-up.
        wait_for(lambda: _serves(port) or None, 120, "the operator's metrics endpoint")
        webhook = WebhookReceiver()
        stack = start_stack(
            tmp_path / "monitoring",
            monitors,
            rule,
            cluster.kubeconfig,
            cluster.bin_dir,
            webhook.url,
            evaluation_interval_seconds=EVALUATION_INTERVAL_SECONDS,
        )
        names = {r["alert"] for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r}
        m = Monitored(namespace, op, stack, webhook, rule, names)
        wait_for(lambda: m.operator_up() == 1.0 or None, 60, "Prometheus scraping the operator")
        yield m
    finally:
        op.stop()
        print(f"--- operator log tail ---\n{op.log_tail()}")
        if stack is not None:
            print(f"--- prometheus log tail ---\n{stack.log_tail('prometheus')}")
            stack.stop()
        if webhook is not None:
            webhook.close()
        cluster.helm("uninstall", RELEASE, "-n", namespace, "--wait", check=False)
