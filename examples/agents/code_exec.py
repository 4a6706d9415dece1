"""A code-execution agent (rollout.agent: examples/agents/code_exec.py:run_episode), and the sandbox its tool
runs the model's code in.

The model writes Python in a fenced block (```python ... ```); generation stops at the closing fence, the
tool runs the code in a sandboxed subprocess, and its output is appended as tool tokens (loss mask 0) in an
```output ... ``` block before the model goes on. The sandbox (docs/agents.md, "How tools are isolated"):
a fresh interpreter (`-I -S -u`: no PYTHON* variables, no site-packages, the standard library only,
unbuffered so stdout and stderr interleave as written) with an empty environment, in a fresh temporary
directory, stdin at end of file, no inherited file descriptor, in its own session (the wall limit kills
its process group); rlimits on CPU seconds, address space, file size, processes and open files, no
capabilities; a Landlock domain that reads only the standard library and the shared libraries, writes only
its directory, and reaches no TCP port, signals no process and opens no abstract socket outside itself (so
/proc/<trainer>/environ, the trainer's files and processes are out of reach). Output is cut at
`output_bytes`.

This file is also the sandbox's launcher: the child runs it as a script (`python -I -S -u code_exec.py`) and
applies the limits to itself before it runs the code, so the module imports the standard library only.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlhf_trainer.agents.contract import Episode, Trajectory

# ------------------------------------------------------------------------------------------- the agent

CODE = re.compile(r"```python\n(.*?)```\s*$", re.DOTALL)  # a python block that ends the turn
CLOSE = "```\n"  # the stop string: a closing fence (the opening one is ```python, never ```\n)


async def run_episode(episode: Episode) -> Trajectory:
    """Generate; while the turn ends in a python block, run it and append its output, then generate again.
    A program the sandbox killed (CPU or wall limit) is a tool error (counted): the model is shown what it
    printed and `killed: <limit>`, and goes on. The episode ends when a turn writes no code, or at maxTurns / the token budget; a tool
    past rollout.agent.tool.timeoutSeconds ends it (tool_timeout). Scored by the job's reward function."""
    while True:
        turn = await episode.generate(stop=(CLOSE,))
        call = CODE.search(episode.codec.decode(turn.token_ids))
        if call is None:
            return episode.finish()
        try:
            output = await episode.call_tool(execute, call.group(1))
        except Exception as failure:  # a ToolFailure: tool_error (killed, or no sandbox here) or tool_timeout
            if getattr(failure, "reason", "") != "tool_error":
                raise
            cause = failure.__cause__
            if isinstance(cause, SandboxKilled):  # what it printed, then why it stopped
                output = f"{cause.execution.output}killed: {cause}"
            else:
                output = f"error: {cause or failure}"
        episode.append_text(f"```output\n{output}\n```\n")


# ----------------------------------------------------------------------------------------- the sandbox


@dataclass(frozen=True)
class SandboxLimits:
    """What one program may use. `processes` counts every process of the user it runs as (RLIMIT_NPROC),
    so 1 means: no child process at all. The kernel exempts uid 0 from that limit (docs/agents.md)."""

    cpu_seconds: int = 3
    wall_seconds: float = 5.0  # keep it under rollout.agent.tool.timeoutSeconds
    memory_mib: int = 512  # address space
    file_mib: int = 8  # the largest file it may write, its output included
    processes: int = 1
    open_files: int = 32
    output_bytes: int = 2048  # of stdout and stderr, shown to the model
    read_paths: tuple[str, ...] = ()  # more read-only directories (a site-packages, to import numpy)
    require_landlock: bool = True  # refuse to run code where the kernel has no Landlock


LIMITS = SandboxLimits()
SETUP_FAILED = 125  # the launcher's exit status when it could not apply the limits (no code ran)


@dataclass(frozen=True)
class Execution:
    """One program's run: its output (cut to output_bytes), exit status (None: killed by a signal), what
    killed it ('' if nothing did), whether the output was cut, and the wall seconds."""

    output: str
    exit_code: int | None
    killed: str
    truncated: bool
    seconds: float


class SandboxKilled(RuntimeError):
    """The program ran past a limit and was killed (`execution` holds what it printed)."""

    def __init__(self, execution: Execution) -> None:
        super().__init__(f"{execution.killed} limit")
        self.execution = execution


class SandboxUnavailable(RuntimeError):
    """The sandbox could not be set up here (no code ran)."""


def run_python(code: str, limits: SandboxLimits = LIMITS) -> Execution:
    """Run `code` as a program in the sandbox; blocks until it exits or the wall limit kills it."""
    with tempfile.TemporaryDirectory(prefix="rlhf-sandbox-") as work, tempfile.TemporaryFile() as out:
        Path(work, "main.py").write_text(code)
        t0 = time.monotonic()
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-u", __file__, json.dumps(asdict(limits))],
            cwd=work,
            env={},
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            close_fds=True,
            start_new_session=True,
        )
        killed = ""
        try:
            proc.wait(timeout=limits.wall_seconds)
        except subprocess.TimeoutExpired:
            killed = "wall time"
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        seconds = time.monotonic() - t0
        out.seek(0)
        raw = out.read(limits.output_bytes + 1)
    status = proc.returncode
    if not killed and status < 0:
        # SIGXCPU at the CPU limit, SIGKILL a second later if the program caught SIGXCPU
        killed = "CPU time" if -status in (signal.SIGXCPU, signal.SIGKILL) else f"signal {-status}"
    text = raw[: limits.output_bytes].decode(errors="replace")
    if status == SETUP_FAILED and text.startswith("sandbox setup failed"):
        raise SandboxUnavailable(text.strip())
    return Execution(text, None if status < 0 else status, killed, len(raw) > limits.output_bytes, seconds)


def execute(code: str) -> str:
    """The tool: the program's output, with its exit status when it failed; raises SandboxKilled when a
    limit killed it, SandboxUnavailable when the sandbox cannot run here."""
    run = run_python(code, LIMITS)
    if run.killed:
        raise SandboxKilled(run)
    text = run.output + ("\n[output truncated]" if run.truncated else "")
    return text if run.exit_code == 0 else f"{text}\n[exit status {run.exit_code}]"


# ------------------------------------------------------------------------- the launcher (in the child)

# Landlock (linux/landlock.h): its syscalls, the file-system rights each ABI version handles, the rule type.
LANDLOCK_CREATE_RULESET, LANDLOCK_ADD_RULE, LANDLOCK_RESTRICT_SELF = 444, 445, 446
RULE_PATH_BENEATH = 1
FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
FS_TRUNCATE, FS_IOCTL_DEV = 1 << 14, 1 << 15
FS_HANDLED = {1: (1 << 13) - 1, 2: (1 << 14) - 1, 3: (1 << 15) - 1, 4: (1 << 15) - 1, 5: (1 << 16) - 1}
FS_ON_A_FILE = FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | FS_TRUNCATE | FS_IOCTL_DEV  # the rest need a dir
NET_TCP = 0b11  # bind and connect (ABI 4)
SCOPE_ALL = 0b11  # abstract unix sockets and signals (ABI 6)
PR_SET_NO_NEW_PRIVS, PR_CAPBSET_DROP = 38, 24
LIBRARY_DIRS = ("/lib", "/lib64", "/usr/lib", "/usr/lib64")


def _landlock(libc: Any, read_dirs: list[str], write_dir: str) -> int:
    """Enter a Landlock domain: read under `read_dirs`, read and write under `write_dir`, nothing else on
    the file system and no exec; no TCP (ABI >= 4); no signal or abstract socket out of the domain (ABI >=
    6). Returns the ABI version, 0 when the kernel has no Landlock."""
    import ctypes

    def call(nr: int, *args: Any) -> int:
        result = int(libc.syscall(nr, *args))
        if result < 0:
            raise OSError(ctypes.get_errno(), f"landlock syscall {nr}")
        return result

    abi = int(libc.syscall(LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(1)))
    if abi < 1:
        return 0
    handled = FS_HANDLED.get(abi, FS_HANDLED[5])
    attr = (ctypes.c_uint64 * 3)(handled, NET_TCP if abi >= 4 else 0, SCOPE_ALL if abi >= 6 else 0)
    size = 8 * (3 if abi >= 6 else 2 if abi >= 4 else 1)  # the fields this ABI reads
    ruleset = call(LANDLOCK_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))

    class PathBeneath(ctypes.Structure):
        _pack_ = 1
        _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]

    read = FS_READ_FILE | FS_READ_DIR
    rules = [(p, read) for p in read_dirs] + [(write_dir, handled & ~FS_EXECUTE)]
    rules += [("/dev/null", FS_READ_FILE | FS_WRITE_FILE), ("/etc/ld.so.cache", FS_READ_FILE)]
    for path, access in rules:
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            continue  # a library directory this system does not have
        if not os.path.isdir(path):
            access &= FS_ON_A_FILE
        rule = PathBeneath(access & handled, fd)
        try:
            call(
                LANDLOCK_ADD_RULE,
                ruleset,
                ctypes.c_int(RULE_PATH_BENEATH),
                ctypes.byref(rule),
                ctypes.c_uint32(0),
            )
        finally:
            os.close(fd)
    call(LANDLOCK_RESTRICT_SELF, ruleset, ctypes.c_uint32(0))
    os.close(ruleset)
    return abi


def _drop_privileges(libc: Any) -> None:
    """No capabilities (root's included: no raising a hard rlimit back, no reaching past file modes) and
    no new privileges through exec."""
    import ctypes

    for cap in range(64):
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) < 0 and ctypes.get_errno() == 22:  # EINVAL: no such cap
            break
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable: all empty, both words
    if libc.capset(ctypes.byref(header), ctypes.byref(data)) < 0:
        raise OSError(ctypes.get_errno(), "capset")
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")


def _confine(limits: SandboxLimits) -> None:
    """Apply every limit to this process; raises when one cannot be applied."""
    import ctypes
    import resource
    import sysconfig

    mib = 1 << 20
    for which, value in (
        (resource.RLIMIT_AS, limits.memory_mib * mib),
        (resource.RLIMIT_FSIZE, limits.file_mib * mib),
        (resource.RLIMIT_NPROC, limits.processes),
        (resource.RLIMIT_NOFILE, limits.open_files),
        (resource.RLIMIT_CORE, 0),
    ):
        resource.setrlimit(which, (value, value))
    # SIGXCPU at the limit (it ends the program unless caught), SIGKILL a second later
    resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_seconds, limits.cpu_seconds + 1))
    libc = ctypes.CDLL(None, use_errno=True)
    _drop_privileges(libc)
    stdlib = {sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"]}
    abi = _landlock(libc, [*stdlib, *LIBRARY_DIRS, *limits.read_paths], os.getcwd())
    if abi == 0 and limits.require_landlock:
        raise OSError("this kernel has no Landlock (SandboxLimits.require_landlock)")


def _launch() -> None:
    """The child: confine itself, then run main.py as __main__; a traceback shows the program's frames."""
    import traceback

    try:
        given = json.loads(sys.argv[1])
        _confine(SandboxLimits(**{**given, "read_paths": tuple(given["read_paths"])}))
        with open("main.py") as f:
            program = compile(f.read(), "main.py", "exec")
    except SyntaxError:
        traceback.print_exc(limit=0)
        sys.exit(1)
    except Exception as e:
        print(f"sandbox setup failed: {type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(SETUP_FAILED)
    del sys.argv[1:]
    try:
        exec(program, {"__name__": "__main__", "__file__": "main.py", "__builtins__": __builtins__})
    except SystemExit:
        raise
    except BaseException as e:
        traceback.print_exception(type(e), e, e.__traceback__.tb_next if e.__traceback__ else None)
        sys.exit(1)


if __name__ == "__main__":
    _launch()
