"""The tests' own helpers: the reader of the driver's per-step reports, on the log shapes Ray really
produces, and kubectl's retry of requests that never reached the API server."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from testkit import support
from testkit.support import Cluster, step_reports

pytestmark = pytest.mark.unit


def test_a_report_glued_behind_a_deduplicated_worker_line_is_still_read() -> None:
    # Seen in CI: Ray's "[repeated 4x across cluster]" line had no newline before the driver's report.
    logs = "\n".join(
        [
            '{"step": 30, "engines": [0, 3]}',
            "\x1b[36m(RolloutEngine pid=2692)\x1b[0m INFO reset prefix cache\x1b[32m [repeated 4x across cluster]"
            '\x1b[0m{"step": 31, "engines": [0, 3]}',
            "(ModelRank pid=435) FutureWarning: all_gather_into_tensor is deprecated",
            '{"step": 32, "engines": [0]}',
        ]
    )
    assert [r["step"] for r in step_reports(logs)] == [30, 31, 32]
    assert step_reports("no reports here\n") == []


def _fake_kubectl(tmp_path: Path, failures: int, stderr: str) -> Cluster:
    """A kubectl that fails `failures` times with `stderr`, then prints "ok"; it counts its calls."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "kubectl"
    script.write_text(
        "#!/bin/sh\n"
        f"n=$(cat {tmp_path}/calls 2>/dev/null || echo 0); n=$((n+1)); echo $n > {tmp_path}/calls\n"
        f'if [ $n -le {failures} ]; then echo "{stderr}" >&2; exit 1; fi\n'
        "echo ok\n"
    )
    os.chmod(script, 0o755)
    return Cluster(kubeconfig=tmp_path / "kubeconfig", bin_dir=bin_dir)


def test_a_request_that_never_reached_the_api_server_is_sent_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(support.time, "sleep", lambda _s: None)
    cluster = _fake_kubectl(tmp_path, 2, "Unable to connect to the server: net/http: TLS handshake timeout")
    assert cluster.kubectl("get", "pods").stdout.strip() == "ok"
    assert (tmp_path / "calls").read_text().strip() == "3"


def test_a_refusal_by_the_api_server_is_not_sent_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(support.time, "sleep", lambda _s: None)
    cluster = _fake_kubectl(tmp_path, 1, "Error from server (Invalid): spec.steps: Invalid value")
    with pytest.raises(AssertionError, match=r"spec\.steps"):
        cluster.kubectl("apply", "-f", "-", input="{}")
    assert (tmp_path / "calls").read_text().strip() == "1"


def test_a_phase_watch_the_api_server_drops_is_started_again(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "kubectl"
    # First watch: one phase, then the stream ends as a dropped watch does. Second: two more, then it stays.
    script.write_text(
        "#!/bin/sh\n"
        f"if [ -e {tmp_path}/once ]; then printf 'Running\\nRestarting\\n'; exec sleep 30; fi\n"
        f"touch {tmp_path}/once; echo Running\n"
    )
    os.chmod(script, 0o755)
    watch = support.PhaseWatch(Cluster(tmp_path / "kubeconfig", bin_dir), "rlhfjob", "j", "ns")
    support.wait_for(lambda: len(watch.phases) >= 2, 10, "the second watch's phases", interval=0.1)
    assert watch.stop() == ["Running", "Restarting"]
    assert watch.restarts == 1
