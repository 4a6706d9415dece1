"""The code-execution example (examples/agents/code_exec.py): its sandbox runs a program and returns its
output; a program past its CPU or wall limit is killed and becomes a tool error of its episode, never the
step's; memory bombs are refused; the program sees no environment variable of the trainer's (neither its
own environment nor /proc/<parent>/environ), no inherited file descriptor, no stdin, no file outside its
directory, no network, and cannot signal the trainer.

The sandbox needs Landlock (Linux >= 5.13 with the LSM enabled; this project's machines have ABI 7): where
it is missing these tests fail with the sandbox's own message ("sandbox setup failed: ... no Landlock").
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest
from rlhf_trainer.agents.contract import Limits, SamplingParams, Trajectory, load_agent_function
from rlhf_trainer.agents.episodes import EpisodeJob, rollout_episodes
from rlhf_trainer.user_code import load_callable
from testkit.agent_doubles import CharCodec, ScriptedEngineClient

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
CODE_EXEC = ROOT / "examples" / "agents" / "code_exec.py"
QUICK = {"cpu_seconds": 1, "wall_seconds": 10.0}  # a second of CPU; the wall limit only for what hangs


@pytest.fixture(scope="module")
def sandbox() -> Any:
    """The example module (loaded as the trainer loads it: by file path)."""
    import sys

    load_callable(f"{CODE_EXEC}:run_python", "test")
    return next(m for m in sys.modules.values() if getattr(m, "__file__", None) == str(CODE_EXEC))


def _run_code(sandbox: Any, code: str, **limits: Any) -> Any:
    return sandbox.run_python(code, sandbox.SandboxLimits(**{**QUICK, **limits}))


def test_it_runs_a_program_and_returns_its_output(sandbox: Any) -> None:
    r = _run_code(sandbox, "import math\nprint(sum(range(10)), math.factorial(5))\nprint('done')")
    assert (r.output, r.exit_code, r.killed, r.truncated) == ("45 120\ndone\n", 0, "", False)


def test_a_failing_program_shows_its_traceback_and_exit_status(sandbox: Any) -> None:
    r = _run_code(sandbox, "print('before')\n1 / 0")
    assert r.exit_code == 1 and not r.killed
    assert r.output.startswith("before\nTraceback") and 'File "main.py", line 2' in r.output
    assert "ZeroDivisionError" in r.output and "code_exec.py" not in r.output  # only the program's frames
    assert sandbox.execute("import sys\nprint('x')\nsys.exit(3)") == "x\n\n[exit status 3]"


def test_output_is_cut_at_output_bytes(sandbox: Any) -> None:
    r = _run_code(sandbox, "print('x' * 100_000)", output_bytes=64)
    assert r.output == "x" * 64 and r.truncated and r.exit_code == 0


def test_an_infinite_loop_is_killed_by_the_cpu_limit(sandbox: Any) -> None:
    r = _run_code(sandbox, "while True:\n    pass", wall_seconds=60.0)
    assert (r.exit_code, r.killed) == (None, "CPU time")  # 1 s of CPU, long before the wall limit


def test_a_sleeping_program_is_killed_by_the_wall_limit_with_its_children(sandbox: Any) -> None:
    r = _run_code(sandbox, "import time\nprint('started', flush=True)\ntime.sleep(60)", wall_seconds=3.0)
    assert (r.exit_code, r.killed, r.output) == (None, "wall time", "started\n")
    assert 3.0 <= r.seconds < 10


@pytest.mark.parametrize(
    "bomb",
    [
        "x = bytearray(8 << 30)",
        "x = ' ' * (1 << 30)",
        "x = [0] * (1 << 28)",
        "x = []\nwhile True:\n    x.append(bytearray(1 << 20))",  # grows a MiB at a time
    ],
)
def test_memory_bombs_are_refused(sandbox: Any, bomb: str) -> None:
    """The address-space limit (256 MiB here) refuses the allocation: MemoryError, before the CPU limit."""
    r = _run_code(sandbox, f"{bomb}\nprint('allocated')", memory_mib=256)
    assert "allocated" not in r.output and r.exit_code == 1 and "MemoryError" in r.output, r


def test_it_cannot_read_the_parents_environment(sandbox: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLHF_SANDBOX_SECRET", "hunter2")
    probe = """
import os
print(sorted(os.environ))
for pid in (os.getppid(), 1):
    try:
        print(open(f"/proc/{pid}/environ").read())
    except OSError as e:
        print("refused", type(e).__name__)
"""
    r = _run_code(sandbox, probe)
    assert r.exit_code == 0, r.output
    assert "hunter2" not in r.output and "RLHF_SANDBOX_SECRET" not in r.output
    assert r.output.splitlines() == ["['LC_CTYPE']", "refused PermissionError", "refused PermissionError"]


def test_no_descriptor_stdin_file_network_or_signal_reaches_out(sandbox: Any, tmp_path: Path) -> None:
    outside = tmp_path / "outside.txt"
    outside.write_text("trainer's file")
    with outside.open() as held:  # a descriptor the trainer holds open
        probe = f"""
import os, signal, socket
def attempt(name, fn):
    try:
        fn()
        print(name, "allowed")
    except (OSError, EOFError) as e:
        print(name, "refused")
attempt("fd", lambda: os.fstat({held.fileno()}))
attempt("stdin", input)
attempt("read", lambda: open({str(outside)!r}).read())
attempt("write", lambda: open("/tmp/rlhf-sandbox-escape", "w").write("x"))
attempt("exec", lambda: os.execv("/bin/true", ["true"]))
attempt("signal", lambda: os.kill(os.getppid(), 0))
attempt("tcp", lambda: socket.create_connection(("127.0.0.1", 9), timeout=1))
attempt("own", lambda: open("scratch.txt", "w").write("mine"))
"""
        r = _run_code(sandbox, probe)
    lines = r.output.splitlines()
    assert lines == [
        "fd refused",
        "stdin refused",
        "read refused",
        "write refused",
        "exec refused",
        "signal refused",
        "tcp refused",
        "own allowed",
    ], r.output
    assert not Path("/tmp/rlhf-sandbox-escape").exists()


def test_limits_cannot_be_raised_and_files_are_capped(sandbox: Any) -> None:
    probe = """
import resource
try:
    resource.setrlimit(resource.RLIMIT_CPU, (100, 100))
    print("raised")
except ValueError:
    print("kept")
try:
    open("big", "wb").write(b"x" * (2 << 20))
except OSError as e:
    print("file refused", e.errno)
"""
    r = _run_code(sandbox, probe, file_mib=1)
    assert r.output.splitlines() == ["kept", "file refused 27"], r.output  # EFBIG


def test_the_working_directory_is_fresh_and_removed(sandbox: Any) -> None:
    first = _run_code(sandbox, "import os\nopen('left.txt', 'w').write('x')\nprint(os.getcwd())")
    second = _run_code(sandbox, "import os\nprint(os.getcwd(), os.listdir('.'))")
    workdir = Path(first.output.strip())
    assert workdir.name.startswith("rlhf-sandbox-") and not workdir.exists()
    assert second.output.split()[1] == "['main.py']" and second.output.split()[0] != str(workdir)


# ---- the agent: tool tokens, and a killed program is the episode's tool error, never the step's -----------


def episode(sandbox: Any, script: list[str], tool_timeout: float = 10.0, max_turns: int = 4) -> Trajectory:
    """One episode of the example's agent (the fixture's module: its LIMITS are the ones a test sets)."""
    codec = CharCodec()
    turns = iter(script)
    client = ScriptedEngineClient(lambda _ids, _p: (codec.encode(next(turns)), 0.0))
    (t,) = asyncio.run(
        rollout_episodes(
            sandbox.run_episode, [EpisodeJob(0, {"prompt": "Q"}, codec.encode("Q:"))],
            [client], per_engine=1, codec=codec, limits=Limits(max_turns, 400),
            sampling=SamplingParams(max_tokens=200), tool_timeout=tool_timeout,
        )
    )  # fmt: skip
    assert client.calls[0][1].stop == ("```\n",)
    return t


def test_the_agent_appends_the_programs_output_as_tool_tokens_and_generates_again(sandbox: Any) -> None:
    assert (
        load_agent_function(f"{CODE_EXEC}:run_episode").__name__ == "run_episode"
    )  # as rollout.agent loads it
    call = "Let me compute.\n```python\nprint(6 * 7)\n```\n"
    t = episode(sandbox, [call, "Answer: 42"])
    tool = "```output\n42\n\n```\n"
    assert t.text == call + tool + "Answer: 42"
    assert (t.turns, t.tool_calls, t.tool_errors, t.end_reason) == (2, 1, 0, "done")
    assert t.loss_mask == [1] * len(call) + [0] * len(tool) + [1] * len("Answer: 42")


def test_an_infinite_loop_is_a_tool_error_of_its_episode_and_the_episode_goes_on(
    sandbox: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sandbox, "LIMITS", sandbox.SandboxLimits(cpu_seconds=1, wall_seconds=30.0))
    loop = "```python\nwhile True:\n    pass\n```\n"
    t = episode(sandbox, [loop, "Answer: 0"], tool_timeout=60.0)
    assert (t.tool_calls, t.tool_errors, t.end_reason, t.valid) == (1, 1, "done", True)
    assert "```output\nkilled: CPU time limit\n```\n" in t.text and t.text.endswith("Answer: 0")


def test_a_tool_past_the_tool_timeout_ends_its_episode_not_the_step(
    sandbox: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """rollout.agent.tool.timeoutSeconds shorter than the sandbox's wall limit: the episode ends as
    tool_timeout with every token so far; the sandbox still kills the program at its own limit."""
    monkeypatch.setattr(sandbox, "LIMITS", sandbox.SandboxLimits(cpu_seconds=1, wall_seconds=2.0))
    hang = "```python\nimport time\ntime.sleep(60)\n```\n"
    t = episode(sandbox, [hang, "never asked"], tool_timeout=0.5)
    assert (t.tool_calls, t.tool_errors, t.end_reason, t.turns) == (1, 1, "tool_timeout", 1)
    assert t.text == hang and "ran past 0.5s" in t.detail


def test_a_turn_without_code_ends_the_episode(sandbox: Any) -> None:
    t = episode(sandbox, ["Answer: 5"])
    assert (t.turns, t.tool_calls, t.end_reason) == (1, 0, "done")


def test_the_sandbox_launcher_uses_the_standard_library_only() -> None:
    """The child runs code_exec.py with -I -S (no site-packages): its top level imports nothing else."""
    import ast

    tree = ast.parse(CODE_EXEC.read_text())
    top = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
    names = {a.name.split(".")[0] for n in top if isinstance(n, ast.Import) for a in n.names}
    names |= {(n.module or "").split(".")[0] for n in top if isinstance(n, ast.ImportFrom)}
    assert names <= {"__future__", "json", "os", "re", "signal", "subprocess", "sys", "tempfile", "time",
                     "dataclasses", "pathlib", "typing"}, names  # fmt: skip
    assert os.path.exists(CODE_EXEC)
