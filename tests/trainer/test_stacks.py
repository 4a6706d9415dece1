"""The trainer's stack snapshots (rlhf_trainer.stacks): faulthandler dumps parsed, real processes
signalled and read within a limit (one of them stopped, so it cannot answer), the verdict reduced from
a snapshot, and the driver's hang watch deadlines."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from rlhf_trainer.stacks import collect, dump, summary
from rlhf_trainer.stacks.watchdog import PhaseWatchdog

pytestmark = pytest.mark.unit

SITE = "/venv/lib/python3.11/site-packages"
OURS = "/app/rlhf_trainer"

DUMP = f"""Thread 0x00007f32c5ebb6c0 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 324 in wait
  File "{SITE}/prometheus_client/exposition.py", line 99 in serve

Current thread 0x00007f32c6c1cb80 (most recent call first):
  File "{OURS}/fault_env.py", line 63 in injected_hang
  File "{OURS}/fault_env.py", line 58 in maybe_hang
  File "{OURS}/workers/rank.py", line 210 in train_actor
  File "{SITE}/ray/_private/function_manager.py", line 689 in actor_method_executor
  File "{SITE}/ray/_private/worker.py", line 946 in main_loop
  File "{SITE}/ray/_private/workers/default_worker.py", line 330 in <module>
"""


def frames(*spec: tuple[str, int, str]) -> list[dict[str, Any]]:
    return [{"file": f, "line": n, "func": fn} for f, n, fn in spec]


def proc(
    who: str, role: str, rank: int | None, pid: int, *threads: list[dict[str, Any]], main: int = 1
) -> dict[str, Any]:
    return {
        "who": who,
        "role": role,
        "rank": rank,
        "pid": pid,
        "pod": "job-trainer-0",
        "answered": True,
        "main_thread": main,
        "threads": [{"ident": i + 1, "current": i == 0, "frames": t} for i, t in enumerate(threads)],
    }


IN_COLLECTIVE = frames(
    (f"{SITE}/torch/distributed/distributed_c10d.py", 4120, "all_gather_into_tensor"),
    (f"{SITE}/deepspeed/comm/torch.py", 210, "all_gather_into_tensor"),
    (f"{SITE}/deepspeed/runtime/zero/partition_parameters.py", 1200, "_all_gather"),
    (f"{OURS}/workers/policy.py", 88, "train"),
    (f"{OURS}/workers/rank.py", 218, "train_actor"),
    (f"{SITE}/ray/_private/worker.py", 946, "main_loop"),
)
HUNG = frames(
    (f"{OURS}/fault_env.py", 63, "injected_hang"),
    (f"{OURS}/fault_env.py", 58, "maybe_hang"),
    (f"{OURS}/workers/rank.py", 210, "train_actor"),
    (f"{SITE}/ray/_private/worker.py", 946, "main_loop"),
)
IDLE = frames(
    (f"{SITE}/ray/_private/worker.py", 946, "main_loop"),
    (f"{SITE}/ray/_private/workers/default_worker.py", 330, "<module>"),
)
POOL_WAIT = frames(
    ("/usr/lib/python3.11/threading.py", 324, "wait"),
    ("/usr/lib/python3.11/concurrent/futures/_base.py", 451, "result"),
    (f"{OURS}/workers/timed_pool.py", 70, "run"),
    (f"{OURS}/workers/reward.py", 190, "score"),
)
USER_FN = frames(
    ("/usr/lib/python3.11/time.py", 1, "sleep_wrapper"),
    ("/jobs/rewards/control_reward.py", 26, "reward"),
    (f"{OURS}/workers/timed_pool.py", 40, "_call"),
    ("/usr/lib/python3.11/threading.py", 982, "run"),
)


def test_a_faulthandler_dump_is_parsed_into_threads_innermost_first() -> None:
    threads = dump.parse(DUMP)
    assert [(t.ident, t.current) for t in threads] == [(0x7F32C5EBB6C0, False), (0x7F32C6C1CB80, True)]
    assert threads[1].frames[0] == dump.Frame(f"{OURS}/fault_env.py", 63, "injected_hang")
    assert len(threads[1].frames) == 6 and threads[0].frames[-1].func == "serve"
    # A file holding two dumps (a collector that could not truncate): only the last one counts.
    assert [len(t.frames) for t in dump.parse(DUMP + DUMP)] == [2, 6]


def test_modules_and_kinds_of_frames() -> None:
    assert (
        summary.module_of(f"{SITE}/torch/distributed/distributed_c10d.py")
        == "torch.distributed.distributed_c10d"
    )
    assert summary.module_of(f"{OURS}/workers/rank.py") == "rlhf_trainer.workers.rank"
    assert summary.module_of("/usr/lib/python3.11/concurrent/futures/_base.py") == "concurrent.futures._base"
    assert summary.module_of("/jobs/rewards/control_reward.py") == "control_reward"
    kinds = [
        summary.kind_of(f)
        for f in (f"{OURS}/x.py", f"{SITE}/ray/x.py", "/usr/lib/python3.11/x.py", "/jobs/r.py")
    ]
    assert kinds == ["ours", "library", "stdlib", "user"]


def snapshot() -> dict[str, Any]:
    return {
        "processes": [
            proc(
                "driver",
                "driver",
                None,
                10,
                frames(
                    ("/usr/lib/python3.11/threading.py", 1, "wait"),
                    (f"{SITE}/ray/_private/worker.py", 2900, "get"),
                    (f"{OURS}/loop.py", 270, "run_step"),
                ),
            ),
            proc("actor rank 0", "actor", 0, 11, IN_COLLECTIVE),
            proc("actor rank 1", "actor", 1, 12, IN_COLLECTIVE),
            proc("actor rank 2", "actor", 2, 13, HUNG),
            proc("actor rank 3", "actor", 3, 14, IN_COLLECTIVE),
            proc("rollout engine 0", "engine", 0, 15, IDLE),
            {
                **proc("rollout engine 1", "engine", 1, 16),
                "answered": False,
                "state": "T (stopped)",
                "limit_seconds": 5.0,
                "threads": [],
            },
            # The reward scorer: its main thread waits on the pool; a pool thread runs the user's function.
            proc("reward scorer", "reward", None, 17, POOL_WAIT, USER_FN),
        ],
        "silent_nodes": ["job-rollout-1: its collector did not return within 60 s"],
        "nccl_traces": [{"pod": "job-trainer-0", "file": "/tmp/rlhf-nccl/trace_2", "bytes": 40960}],
    }


def test_the_verdict_counts_the_crowd_and_names_the_odd_ones_out() -> None:
    lines = summary.verdict(snapshot())
    assert lines == [
        "driver in `wait` (threading:1) ← `run_step` (rlhf_trainer.loop:270)",
        "3 of 4 actor ranks waiting in the collective `all_gather_into_tensor` (torch.distributed.distributed_c10d) "
        "← `train` (rlhf_trainer.workers.policy:88); "
        "actor rank 2 in `injected_hang` (rlhf_trainer.fault_env:63)",
        "rollout engine 0 idle (waiting for work); "
        "rollout engine 1 (pid 16, pod job-trainer-0) did not answer within 5.0 s (state T (stopped))",
        "reward scorer in `sleep_wrapper` (time:1) ← `reward` (control_reward:26)",
        "node job-rollout-1: its collector did not return within 60 s",
        "NCCL flight recorder dumps (a collective timed out): /tmp/rlhf-nccl/trace_2 (40960 bytes) on job-trainer-0",
    ]
    # Two ranks apart: each named, none counted as the crowd.
    two = {
        "processes": [
            proc("actor rank 0", "actor", 0, 1, IN_COLLECTIVE),
            proc("actor rank 1", "actor", 1, 2, HUNG),
        ]
    }
    assert summary.verdict(two) == [
        "actor rank 0 waiting in the collective `all_gather_into_tensor` (torch.distributed.distributed_c10d) "
        "← `train` (rlhf_trainer.workers.policy:88); actor rank 1 in `injected_hang` (rlhf_trainer.fault_env:63)"
    ]
    annotated = summary.annotate(snapshot())
    reward = annotated["processes"][-1]
    assert reward["work_thread"] == 2 and "control_reward" in reward["where"]


def _armed(tmp: Path, who: str, role: str, **env_extra: str) -> subprocess.Popen[str]:
    script = (
        "import sys, time\n"
        "from rlhf_trainer.stacks import dump\n"
        f"dump.arm({who!r}, {role!r}, 0, node_id='n1')\n"
        "def waiting_here():\n"
        "    while True:\n"
        "        time.sleep(0.05)\n"
        "print('armed', flush=True)\n"
        "waiting_here()\n"
    )
    env = {**os.environ, dump.REGISTRY_ENV: str(tmp), **env_extra}
    p = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "armed"
    return p


def test_real_processes_answer_and_a_stopped_one_is_named_within_the_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(dump.REGISTRY_ENV, str(tmp_path))
    alive, stopped, gone = (_armed(tmp_path, f"p{i}", "actor") for i in range(3))
    try:
        os.kill(stopped.pid, signal.SIGSTOP)
        gone.kill()
        gone.wait()
        started = time.monotonic()
        out = {p["pid"]: p for p in collect.collect_node("n1", limit=1.5)}
        took = time.monotonic() - started
        assert set(out) == {alive.pid, stopped.pid}  # the dead one is left out, its files removed
        assert not (tmp_path / f"{gone.pid}.json").exists()
        assert out[alive.pid]["answered"] and out[alive.pid]["seconds"] < 1.5
        main = next(t for t in out[alive.pid]["threads"] if t["ident"] == out[alive.pid]["main_thread"])
        assert main["frames"][0]["func"] == "waiting_here"
        assert out[stopped.pid] | {"answered": False, "state": "T (stopped)"} == out[stopped.pid]
        assert 1.5 <= took < 4.0, took  # waited for the stopped one up to the limit, no longer
        assert collect.collect_node("other-node", limit=0.5) == []  # another node's processes are not ours
        # Two jobs on one Ray head (the dev stand-in): a snapshot of one leaves the other's processes out.
        other = _armed(tmp_path, "p9", "actor", RLHF_JOB_NAME="b", RLHF_NAMESPACE="ns")
        try:
            mine = {p["pid"] for p in collect.collect_node("n1", limit=0.5, job="ns/a")}
            theirs = {p["pid"] for p in collect.collect_node("n1", limit=0.5, job="ns/b")}
        finally:
            other.kill()
            other.wait()
        assert other.pid not in mine and other.pid in theirs and alive.pid in mine
        traces = tmp_path / "nccl"
        traces.mkdir()
        (traces / "trace_1").write_bytes(b"x" * 7)
        assert [(t["file"], t["bytes"]) for t in collect.flight_records(traces)] == [
            (str(traces / "trace_1"), 7)
        ]
    finally:
        for p in (alive, stopped):
            p.kill()
            p.wait()


def test_the_hang_watch_snapshots_a_phase_past_its_deadline_once() -> None:
    now = [0.0]
    seen: list[tuple[str, int, float]] = []
    watch = PhaseWatchdog(
        lambda: {"processes": []},
        lambda p, s, r, snap: seen.append((p, s, r)),
        floor=10,
        factor=5,
        clock=lambda: now[0],
    )
    watch.started("generation", 1)
    now[0] = 9.0
    watch.check()
    assert not seen  # the floor holds on the first run of a phase
    watch.ended("generation", 9.0)
    assert watch.deadline("generation") == 45.0  # 5 x the longest run so far
    watch.started("generation", 2)
    now[0] += 46.0
    watch.check()
    watch.check()
    assert seen == [("generation", 2, 46.0)]  # once per phase run
    watch.started("reward", 2)
    now[0] += 11.0
    failing = PhaseWatchdog(
        lambda: 1 / 0,
        lambda p, s, r, snap: seen.append((p, s, snap["silent_nodes"][0])),
        floor=1,
        clock=lambda: now[0],
    )  # type: ignore[arg-type,return-value]
    failing.started("reward", 3)
    now[0] += 2
    failing.check()
    assert seen[-1] == ("reward", 3, "the snapshot failed: ZeroDivisionError: division by zero")


def test_the_hang_watch_names_a_stuck_phase_while_another_ran_beside_it() -> None:
    """Phases that run at once (the experience forwards): the one that ends does not hide the one still
    running, which is snapshotted once it is past its own deadline."""
    now = [0.0]
    seen: list[tuple[str, int, float]] = []
    watch = PhaseWatchdog(
        lambda: {"processes": []},
        lambda p, s, r, snap: seen.append((p, s, r)),
        floor=10,
        clock=lambda: now[0],
    )
    watch.started("reference", 3)
    watch.started("critic_values", 3)
    now[0] = 2.0
    watch.ended("critic_values", 2.0)  # started last, ended first
    now[0] = 12.0
    watch.check()
    watch.check()
    assert seen == [("reference", 3, 12.0)]
