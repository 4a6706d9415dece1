"""What the operator and the trainer serve: the metrics (and the operator's health) path, read-only.

Each server is started as the processes start it, on loopback and a free port; every other path is a
404 and every write method a 405, so a port opened for scraping serves nothing else (docs/security.md).
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from testkit.support import free_port, wait_for

pytestmark = pytest.mark.security

WRITES = ("POST", "PUT", "PATCH", "DELETE")  # and anything else but GET


def _up(url: str) -> bool | None:
    try:
        return httpx.get(url, timeout=2).status_code == 200 or None
    except httpx.HTTPError:
        return None


def assert_read_only(base: str, path: str, must_contain: str) -> None:
    wait_for(lambda: _up(base + path), 20, f"{base}{path}")
    ok = httpx.get(base + path, timeout=5)
    assert ok.status_code == 200 and must_contain in ok.text, ok.text[:300]
    for other in ("/", "/debug", "/metrics/../admin", path + "x", "/api/jobs/"):
        if other == path:
            continue
        resp = httpx.get(base + other, timeout=5)
        assert resp.status_code == 404, f"GET {other}: {resp.status_code} {resp.text[:200]}"
    for method in WRITES:
        resp = httpx.request(method, base + path, content=b"x", timeout=5)
        assert resp.status_code == 405, f"{method} {path}: {resp.status_code} {resp.text[:200]}"


def test_trainer_metrics_serve_only_metrics_read_only() -> None:
    from rlhf_trainer.metrics import TrainerExporter

    port = free_port()
    TrainerExporter("sec-job").serve(port, addr="127.0.0.1")
    assert_read_only(f"http://127.0.0.1:{port}", "/metrics", 'rlhf_steps_completed_total{rlhfjob="sec-job"}')


def test_operator_metrics_serve_only_metrics_read_only() -> None:
    from rlhf_operator import metrics

    port = free_port()
    metrics.serve(port, "127.0.0.1")
    assert_read_only(f"http://127.0.0.1:{port}", "/metrics", "rlhf_operator_")


@pytest.fixture
def standby() -> Iterator[str]:
    from rlhf_operator.leader import standby_health

    port = free_port()
    server = standby_health(f"http://127.0.0.1:{port}/healthz")
    assert server is not None
    yield f"http://127.0.0.1:{port}"
    server.shutdown()
    server.server_close()


def test_standby_health_serves_only_its_probe_path(standby: str) -> None:
    assert_read_only(standby, "/healthz", "standby")
