"""A real Prometheus and a real Alertmanager for the alerting tests, configured from the chart itself.

Owns: turning the rendered ServiceMonitor/PodMonitor into `kubernetes_sd_configs` scrape jobs (as the
Prometheus Operator would), the rule file from the rendered PrometheusRule, the two processes on
loopback with their state in a temporary directory, and the webhook receiver that records what
Alertmanager delivers. It must not hand-write targets or rules: both come from `helm template`.
"""

from __future__ import annotations

import http.server
import json
import re
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from testkit.support import free_port, terminate

# The dev-override stand-in (docs/development.md): pods here are KWOK fakes, so a discovered pod IP serves
# nothing. The trainer of every RLHFJob runs on the local Ray head and the operator is a host process,
# both on loopback; this one relabel step sends the scrape of a discovered target to 127.0.0.1 on the
# target's own port. Discovery, selector, port name and path stay the monitors'. The real-node issue
# removes this step: Prometheus then scrapes the pod IP.
DEV_OVERRIDE_HOST = "127.0.0.1"
# Alertmanager's route: every alert its own group; a group's first notification after GROUP_WAIT, each
# later one (a resolved notification) at the group's next flush, GROUP_INTERVAL after the last. The
# tests' delivery bounds are derived from these (monitored.py).
GROUP_WAIT_SECONDS = 0
GROUP_INTERVAL_SECONDS = 1


def alertmanager_binary() -> str:
    found = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
    if not found:
        raise AssertionError(
            "Alertmanager not found: `scripts/setup.sh` installs Debian's prometheus-alertmanager "
            "(apt-get install -y prometheus-alertmanager)"
        )
    return found


def prometheus_binary(bin_dir: Path) -> str:
    """The Prometheus built by `make cluster-build` (Debian's has no Kubernetes service discovery)."""
    path = bin_dir / "prometheus"
    if not path.exists():
        raise AssertionError(
            f"{path} not found: `make cluster-build` builds Prometheus from the Go module proxy "
            "(Debian's prometheus 2.42 is built without kubernetes_sd_configs)"
        )
    return str(path)


def _label(name: str) -> str:
    """A Kubernetes label name as Prometheus' service discovery spells it in meta labels."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def _selector_relabels(selector: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    """keep-relabels for a LabelSelector over the discovered object's labels (kind: pod or service)."""
    out: list[dict[str, Any]] = []
    for key, value in (selector.get("matchLabels") or {}).items():
        out.append(
            {
                "action": "keep",
                "source_labels": [f"__meta_kubernetes_{kind}_label_{_label(key)}"],
                "regex": re.escape(str(value)),
            }
        )
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        present = f"__meta_kubernetes_{kind}_labelpresent_{_label(key)}"
        label = f"__meta_kubernetes_{kind}_label_{_label(key)}"
        if op == "Exists":
            out.append({"action": "keep", "source_labels": [present], "regex": "true"})
        elif op == "DoesNotExist":
            out.append({"action": "drop", "source_labels": [present], "regex": "true"})
        elif op in ("In", "NotIn"):
            regex = "|".join(re.escape(v) for v in values)
            out.append({"action": "keep" if op == "In" else "drop", "source_labels": [label], "regex": regex})
        else:
            raise AssertionError(f"selector operator {op} is not supported")
    return out


def _namespaces(monitor: dict[str, Any]) -> dict[str, Any]:
    sel = monitor["spec"].get("namespaceSelector") or {}
    if sel.get("any"):
        return {}
    names = sel.get("matchNames") or [monitor["metadata"]["namespace"]]
    return {"namespaces": {"names": names}}


def _dev_override_relabel() -> dict[str, Any]:
    return {
        "source_labels": ["__address__"],
        "regex": r"(.*):(\d+)",
        "target_label": "__address__",
        "replacement": f"{DEV_OVERRIDE_HOST}:$2",
    }


def scrape_configs(monitors: list[dict[str, Any]], kubeconfig: Path) -> list[dict[str, Any]]:
    """One scrape job per endpoint of each ServiceMonitor / PodMonitor, labelled as the Prometheus
    Operator labels them (`job` = the Service name, or `<namespace>/<PodMonitor name>`; `namespace`,
    `pod`, `container`, `endpoint`), followed by the dev-override relabel step."""
    jobs: list[dict[str, Any]] = []
    for m in monitors:
        kind, spec, meta = m["kind"], m["spec"], m["metadata"]
        if kind == "ServiceMonitor":
            role, endpoints, obj = "endpointslice", spec["endpoints"], "service"
        elif kind == "PodMonitor":
            role, endpoints, obj = "pod", spec["podMetricsEndpoints"], "pod"
        else:
            continue
        for i, ep in enumerate(endpoints):
            relabels = _selector_relabels(spec["selector"], obj)
            if kind == "ServiceMonitor":
                relabels += [
                    {"action": "keep", "source_labels": ["__meta_kubernetes_endpointslice_port_name"],
                     "regex": re.escape(ep["port"])},
                    {"source_labels": ["__meta_kubernetes_service_name"], "target_label": "service"},
                    {"source_labels": ["__meta_kubernetes_service_name"], "target_label": "job"},
                ]  # fmt: skip
            else:
                relabels += [
                    {"action": "keep", "source_labels": ["__meta_kubernetes_pod_container_port_name"],
                     "regex": re.escape(ep["port"])},
                    {"action": "drop", "source_labels": ["__meta_kubernetes_pod_phase"],
                     "regex": "Succeeded|Failed"},
                    {"target_label": "job", "replacement": f"{meta['namespace']}/{meta['name']}"},
                ]  # fmt: skip
            relabels += [
                {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
                {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
                {"source_labels": ["__meta_kubernetes_pod_container_name"], "target_label": "container"},
                {"target_label": "endpoint", "replacement": ep["port"]},
                _dev_override_relabel(),
            ]
            jobs.append(
                {
                    "job_name": f"{kind.lower()}/{meta['namespace']}/{meta['name']}/{i}",
                    "honor_labels": bool(ep.get("honorLabels", False)),
                    "scrape_interval": ep.get("interval", "30s"),
                    "scrape_timeout": ep.get("scrapeTimeout", "10s"),
                    "metrics_path": ep.get("path", "/metrics"),
                    "kubernetes_sd_configs": [
                        {"role": role, "kubeconfig_file": str(kubeconfig), **_namespaces(m)}
                    ],
                    "relabel_configs": relabels,
                }
            )
    return jobs


@dataclass
class Delivery:
    """One webhook notification from Alertmanager, with the wall-clock time it arrived."""

    received: float
    payload: dict[str, Any]


class WebhookReceiver:
    """A tiny HTTP server on loopback that records every notification Alertmanager posts."""

    def __init__(self) -> None:
        self.deliveries: list[Delivery] = []
        self._lock = threading.Lock()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with outer._lock:
                    outer.deliveries.append(Delivery(time.time(), body))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/alerts"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def alerts(self, status: str | None = None, **labels: str) -> list[tuple[float, dict[str, Any]]]:
        """(arrival time, alert) of every delivered alert with this status and these labels."""
        with self._lock:
            found = [(d.received, a) for d in self.deliveries for a in d.payload.get("alerts", [])]
        return [
            (t, a)
            for t, a in found
            if (status is None or a["status"] == status)
            and all(a["labels"].get(k) == v for k, v in labels.items())
        ]

    def close(self) -> None:
        self.server.shutdown()


@dataclass
class MonitoringStack:
    """Prometheus and Alertmanager as local processes; `stop()` ends both."""

    workdir: Path
    prometheus_url: str
    alertmanager_url: str
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """An instant query, evaluated now or at the Unix time `at`."""
        params: dict[str, str | float] = {"query": expr}
        if at is not None:
            params["time"] = at
        resp = httpx.get(f"{self.prometheus_url}/api/v1/query", params=params, timeout=10)
        body = resp.json()
        assert body.get("status") == "success", (expr, body)
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def targets(self) -> list[dict[str, Any]]:
        resp = httpx.get(f"{self.prometheus_url}/api/v1/targets", timeout=10)
        active: list[dict[str, Any]] = resp.json()["data"]["activeTargets"]
        return active

    def rule_alerts(self) -> list[dict[str, Any]]:
        resp = httpx.get(f"{self.prometheus_url}/api/v1/alerts", timeout=10)
        alerts: list[dict[str, Any]] = resp.json()["data"]["alerts"]
        return alerts

    def log_tail(self, name: str, lines: int = 30) -> str:
        path = self.workdir / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def stop(self) -> None:
        for p in self.procs:
            terminate(p, grace=20)


def _wait_ready(url: str, proc: subprocess.Popen[bytes], log: Path, what: str) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(
                f"{what} exited ({proc.returncode}):\n{log.read_text(errors='replace')[-3000:]}"
            )
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{what} not ready after 60 s:\n{log.read_text(errors='replace')[-3000:]}")


def start_stack(
    workdir: Path,
    monitors: list[dict[str, Any]],
    rule: dict[str, Any],
    kubeconfig: Path,
    bin_dir: Path,
    webhook_url: str,
    evaluation_interval_seconds: int = 1,
) -> MonitoringStack:
    """Alertmanager (every alert its own group, GROUP_WAIT/GROUP_INTERVAL, resolved notifications on) and
    Prometheus (the monitors' scrape jobs, the PrometheusRule's groups, evaluated every
    `evaluation_interval_seconds`; the monitors set their own scrape interval)."""
    workdir.mkdir(parents=True, exist_ok=True)
    am_port, prom_port = free_port(), free_port()
    am_config = {
        "route": {
            "receiver": "test-webhook",
            "group_by": ["..."],  # one notification per alert: what arrives is that alert's story
            "group_wait": f"{GROUP_WAIT_SECONDS}s",
            "group_interval": f"{GROUP_INTERVAL_SECONDS}s",
            "repeat_interval": "1h",
        },
        "receivers": [
            {"name": "test-webhook", "webhook_configs": [{"url": webhook_url, "send_resolved": True}]}
        ],
    }
    (workdir / "alertmanager.yml").write_text(yaml.safe_dump(am_config))
    rules = workdir / "rules.yml"
    rules.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}, sort_keys=False))
    interval = f"{evaluation_interval_seconds}s"
    prom_config = {
        "global": {"scrape_interval": interval, "evaluation_interval": interval, "scrape_timeout": interval},
        "rule_files": [str(rules)],
        "alerting": {"alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{am_port}"]}]}]},
        "scrape_configs": scrape_configs(monitors, kubeconfig),
    }
    (workdir / "prometheus.yml").write_text(yaml.safe_dump(prom_config, sort_keys=False))
    stack = MonitoringStack(workdir, f"http://127.0.0.1:{prom_port}", f"http://127.0.0.1:{am_port}")
    am_log, prom_log = workdir / "alertmanager.log", workdir / "prometheus.log"
    stack.procs.append(
        subprocess.Popen(
            [
                alertmanager_binary(),
                f"--config.file={workdir / 'alertmanager.yml'}",
                f"--storage.path={workdir / 'alertmanager'}",
                f"--web.listen-address=127.0.0.1:{am_port}",
                "--cluster.listen-address=",  # one instance: no gossip port
            ],
            stdout=am_log.open("wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    )
    try:
        _wait_ready(f"{stack.alertmanager_url}/-/ready", stack.procs[0], am_log, "alertmanager")
        stack.procs.append(
            subprocess.Popen(
                [
                    prometheus_binary(bin_dir),
                    f"--config.file={workdir / 'prometheus.yml'}",
                    f"--storage.tsdb.path={workdir / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{prom_port}",
                ],
                stdout=prom_log.open("wb"),
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
        _wait_ready(f"{stack.prometheus_url}/-/ready", stack.procs[1], prom_log, "prometheus")
    except BaseException:
        stack.stop()
        raise
    return stack
