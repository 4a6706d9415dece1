"""The local Ray head that stands in for every RayCluster's head: how it is started, and a command line so
`make test` starts one for all its stages.

The `ray_head` fixture (tests/conftest.py) starts it for a test session unless one is already up on its
dashboard port, and then leaves that one alone. scripts/test.sh starts it once before the first stage that
uses it and stops it after the last: each stage starting and stopping its own cost about 12 s (measured
2026-11-29: 7.8 s to the dashboard, 2-5 s to stop).

    python -m testkit.ray_head start --dir DIR   # up in its own process group: DIR/ray-head.{pid,log}
    python -m testkit.ray_head stop --dir DIR

Stopped by `testkit.support.stop_ray_start` (`ray start` alone, then its group), never with `ray stop`,
which would kill every Ray process on the machine (a trainer run of another session included).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from testkit.support import RAY_DASHBOARD_PORT, RAY_PORT, VENV_BIN, _dashboard_up, stop_ray_start

START_TIMEOUT_SECONDS = 120
STOP_GRACE_SECONDS = 30.0
DASHBOARD = f"http://127.0.0.1:{RAY_DASHBOARD_PORT}"
ENDED = frozenset({"SUCCEEDED", "FAILED", "STOPPED"})


def head_env() -> dict[str, str]:
    """The head's environment. Token auth off explicitly: Ray turns it on whenever ~/.ray/auth_token exists
    (any earlier `ray.init()` writes one), and this head listens on loopback only."""
    env = {
        **os.environ,
        "PATH": f"{VENV_BIN}:{os.environ['PATH']}",
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_AUTH_MODE": "disabled",
    }
    env.pop("RAY_ADDRESS", None)
    return env


def head_command() -> list[str]:
    """`ray start --head --block` on the fixed ports, with a short temp dir of its own (Ray's socket paths
    have a length limit)."""
    temp = Path(tempfile.mkdtemp(prefix="rlhf-ray-"))
    return [
        str(VENV_BIN / "ray"),
        "start",
        "--head",
        "--block",
        f"--port={RAY_PORT}",
        "--dashboard-host=127.0.0.1",
        f"--dashboard-port={RAY_DASHBOARD_PORT}",
        # Logical CPUs and GPUs for several jobs at once: each job's processes reserve whole GPUs and
        # their CPU share in placement groups, all or nothing per group, so two jobs that each got
        # part of a 4-CPU head waited on each other (a leftover job of an earlier test included).
        "--num-cpus=16",
        # Logical GPUs for every job's whole-GPU placement under the CPU stand-in (RLHF_GPU_STANDIN).
        "--num-gpus=16",
        "--include-dashboard=true",
        "--disable-usage-stats",
        f"--temp-dir={temp}",
        # Ray's default worker range (10002-19999) holds our fixed ports; keep workers clear of them.
        "--min-worker-port=30000",
        "--max-worker-port=30999",
    ]


def start(log: Path) -> subprocess.Popen[bytes]:
    """The head in its own process group (session), its output in `log`; returns once its dashboard
    answers. Raises RuntimeError, saying where its log is, when it exits or does not answer."""
    with log.open("wb") as out:
        proc = subprocess.Popen(
            head_command(), env=head_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    deadline = time.monotonic() + START_TIMEOUT_SECONDS
    while not _dashboard_up():
        if proc.poll() is not None:
            raise RuntimeError(f"the local Ray head exited ({proc.returncode}); see {log}")
        if time.monotonic() > deadline:
            stop_ray_start(proc, STOP_GRACE_SECONDS)
            raise RuntimeError(
                f"the local Ray head's dashboard did not answer in {START_TIMEOUT_SECONDS}s; see {log}"
            )
        time.sleep(0.5)
    return proc


def jobs(dashboard: str = DASHBOARD) -> dict[str, str]:
    """{submission id: status} of every Ray job the head knows (its Jobs API)."""
    resp = httpx.get(f"{dashboard}/api/jobs/", timeout=30)
    resp.raise_for_status()
    return {j["submission_id"]: j["status"] for j in resp.json() if j.get("submission_id")}


def stop_jobs(keep: set[str], dashboard: str = DASHBOARD, timeout: float = 60) -> list[str]:
    """Stop every Ray job not in `keep` that has not ended, and wait until each has: a head shared by
    several test sessions (`make test`'s stages) must not carry one session's trainers into the next,
    as stopping a session's own head did. Returns the ids it stopped."""
    left = sorted(sid for sid, status in jobs(dashboard).items() if sid not in keep and status not in ENDED)
    for sid in left:
        httpx.post(f"{dashboard}/api/jobs/{sid}/stop", timeout=30)
    deadline = time.monotonic() + timeout
    while left and time.monotonic() < deadline:
        now = jobs(dashboard)
        if all(now.get(sid) in ENDED for sid in left):
            break
        time.sleep(0.5)
    else:
        if left:
            raise RuntimeError(f"Ray jobs still not ended {timeout:.0f}s after their stop: {left}")
    return left


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m testkit.ray_head", description=__doc__.split("\n\n")[0])
    p.add_argument("action", choices=("start", "stop"))
    p.add_argument("--dir", type=Path, required=True, help="where the pid file and the head's log go")
    args = p.parse_args(argv)
    pid_file = args.dir / "ray-head.pid"
    if args.action == "start":
        if _dashboard_up():  # a developer's, say: used as the fixture uses it, and not stopped here
            print(f"[ray-head] one is already up (its dashboard answers on :{RAY_DASHBOARD_PORT}): using it")
            return 0
        t0 = time.monotonic()
        try:
            proc = start(args.dir / "ray-head.log")
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        pid_file.write_text(str(proc.pid))
        print(f"[ray-head] up in {time.monotonic() - t0:.1f}s at 127.0.0.1:{RAY_PORT} (pid {proc.pid})")
        return 0
    if not pid_file.exists():
        print(f"[ray-head] no {pid_file}: nothing to stop")
        return 0
    t0 = time.monotonic()
    stop_ray_start(int(pid_file.read_text()), STOP_GRACE_SECONDS)
    pid_file.unlink()
    print(f"[ray-head] stopped in {time.monotonic() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
