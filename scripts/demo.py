"""`make demo`: the whole product on one machine, as a new user first sees it.

1. the local control plane (real etcd, kube-apiserver, controller-manager, scheduler, KWOK, KubeRay)
   and a real node (kubelet, containerd, kube-proxy, CoreDNS);
2. `make images`: the operator and CPU trainer images, built here (no registry);
3. `helm install` of charts/rlhf-operator with those images: the operator runs in its pod;
4. `kubectl apply` of the tiny job (examples/rlhf-tiny-volume.yaml, examples/rlhfjob-tiny-pods.yaml):
   KubeRay starts the head, trainer and rollout pods on the real node; live progress until it Succeeds.

The fallback for a machine that cannot run containers (RLHF_REAL_NODE=0): KWOK nodes only, the
operator as a local process, and a local Ray head standing in for the RayCluster's head pod (the
development override, docs/development.md).

Everything it starts lives under .demo/ (and /tmp/rlhf-tiny, the example's paths) on ports of its own,
so it runs beside a test cluster. Ctrl-C, or any failure, cleans up; a second run starts clean.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / ".demo"
VENV_BIN = ROOT / ".venv" / "bin"
PORT_OFFSET = int(os.environ.get("RLHF_DEMO_PORT_OFFSET", "100"))
RAY_PORT, DASHBOARD_PORT = 16379 + PORT_OFFSET, 18265 + PORT_OFFSET
TINY = Path("/tmp/rlhf-tiny")  # the paths examples/rlhfjob-tiny.yaml names
NAMESPACE, JOB, RELEASE = "default", "tiny", "rlhf-operator"
TIMEOUT = float(os.environ.get("RLHF_DEMO_TIMEOUT", "1800"))
REAL_NODE = os.environ.get("RLHF_REAL_NODE", "1") not in ("0", "false", "no")
TRAINER_UID = 10001  # the trainer image's user: it reads the model and writes checkpoints
PIDS = DEMO / "pids.json"

console = Console()
ENV = {
    **os.environ,
    "RLHF_CLUSTER_DIR": str(DEMO / "cluster"),
    "RLHF_CLUSTER_PORT_OFFSET": str(PORT_OFFSET),
    "KUBECONFIG": str(DEMO / "cluster" / "kubeconfig"),
    "PATH": f"{DEMO / 'cluster' / 'bin'}:{VENV_BIN}:{os.environ['PATH']}",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "disabled",  # the demo head listens on loopback only
}
ENV.pop("RAY_ADDRESS", None)


class DemoError(Exception):
    pass


def run(*cmd: str, quiet: bool = False, timeout: float = 1800) -> str:
    proc = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    if proc.returncode != 0:
        raise DemoError(
            f"`{' '.join(cmd)}` failed ({proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}"
        )
    if not quiet and proc.stdout.strip():
        console.print(proc.stdout.rstrip(), highlight=False)
    return proc.stdout


PROGRESS_LINES = ("[build]", "[images]", "[up]", "operator-image:", "trainer-image:", "error")


def show_progress(line: str) -> None:
    """A long command's progress line (PROGRESS_LINES), shown dimmed; other lines are kept, not shown."""
    if line.startswith(PROGRESS_LINES):
        console.print(f"  [dim]{escape(line.rstrip())}[/]", highlight=False)


class Background:
    """A long command, its progress lines shown as they come (a cold build is many minutes); it runs
    beside the foreground until joined (the images beside the Go builds: one mostly waits on the disk
    and the network, the other on the CPU)."""

    def __init__(self, name: str, *cmd: str) -> None:
        self.cmd = cmd
        self.lines: list[str] = []
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT
        )
        self.reader = threading.Thread(target=self._read, name=name, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            show_progress(line)

    def join(self, timeout: float = 5400) -> str:
        try:
            self.proc.wait(timeout=max(1.0, timeout - (time.monotonic() - self.started)))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise DemoError(f"`{' '.join(self.cmd)}` took longer than {timeout:.0f}s") from None
        self.reader.join()
        if self.proc.returncode != 0:
            raise DemoError(
                f"`{' '.join(self.cmd)}` failed ({self.proc.returncode}):\n{''.join(self.lines[-40:])}"
            )
        return "".join(self.lines)


def run_live(*cmd: str, timeout: float = 5400) -> str:
    """Runs a long command in the foreground, showing its progress lines as they come."""
    return Background(cmd[0], *cmd).join(timeout)


# From the builds' end to Succeeded: 174 s in a cold demo (2026-12-07), the job 123 s of it.
AFTER_BUILDS_S = 180


class Estimate:
    """A progress line every 30 s while the builds run, with what is left: each build's plan (the cold
    estimates of the parts its cache lacks, measured here) less the time it has run, the longer of the
    two, plus what follows them (AFTER_BUILDS_S)."""

    def __init__(self, plans: dict[str, float], every: float = 30.0) -> None:
        self.plans, self.every = plans, every
        self.started = {name: time.monotonic() for name in plans}
        self.finished: dict[str, float] = {}
        self.t0 = time.monotonic()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._tick, name="estimate", daemon=True)

    def __enter__(self) -> Estimate:
        console.print(f"  [dim]{escape('[progress] ' + self.line())}[/]", highlight=False)
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        self.thread.join()

    def done(self, name: str) -> None:
        self.finished[name] = time.monotonic()

    def left_s(self) -> float:
        now = time.monotonic()
        builds = [
            0.0 if name in self.finished else max(30.0, plan - (now - self.started[name]))
            for name, plan in self.plans.items()
        ]
        return max(builds, default=0.0) + AFTER_BUILDS_S

    def line(self) -> str:
        doing = ", ".join(name for name in self.plans if name not in self.finished) or "the control plane"
        return (
            f"{time.monotonic() - self.t0:.0f}s in; running: {doing}; about {self.left_s() / 60:.0f} min "
            "left (cold parts as measured on a 2-core machine)"
        )

    def _tick(self) -> None:
        while not self.stop.wait(self.every):
            console.print(f"  [dim]{escape('[progress] ' + self.line())}[/]", highlight=False)


def plan_seconds(*cmd: str, key: str) -> float:
    """A build's `plan`: the seconds its cold parts are estimated at (0 when all is cached)."""
    out = run(*cmd, quiet=True, timeout=300)
    for line in out.splitlines():
        show_progress(line)
        if line.startswith(f"{key}: "):
            return float(line.split(": ", 1)[1])
    return 0.0


def step(title: str) -> float:
    console.rule(f"[bold]{title}")
    return time.monotonic()


def done(t0: float, what: str) -> None:
    console.print(f"[green]✓[/] {what} [dim]({time.monotonic() - t0:.1f}s)[/]")


# ------------------------------------------------------------------------------------------ processes


def spawn(name: str, cmd: list[str], extra_env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    log = (DEMO / f"{name}.log").open("ab")
    proc = subprocess.Popen(
        cmd,
        env={**ENV, **(extra_env or {})},
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
        start_new_session=True,
    )
    pids = json.loads(PIDS.read_text()) if PIDS.exists() else {}
    pids[name] = proc.pid
    PIDS.write_text(json.dumps(pids))
    return proc


def stop_group(pid: int) -> None:
    for sig, grace in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            try:
                os.killpg(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)


def cleanup(quiet: bool = False) -> None:
    """Stops everything a demo run (this one or an interrupted earlier one) started."""
    if not quiet:
        console.rule("[bold]cleaning up")
    if (DEMO / "cluster" / "kubeconfig").exists():
        subprocess.run(
            ["kubectl", "delete", "rlhfjob", JOB, "-n", NAMESPACE, "--ignore-not-found", "--wait=false"],
            env=ENV,
            capture_output=True,
            timeout=60,
        )
    if PIDS.exists():
        for name, pid in json.loads(PIDS.read_text()).items():
            stop_group(int(pid))
            if not quiet:
                console.print(f"stopped {name}")
        PIDS.unlink()
    subprocess.run(
        [sys.executable, "devcluster/devcluster.py", "down"],
        env=ENV,
        capture_output=True,
        timeout=120,
        cwd=ROOT,
    )
    shutil.rmtree(Path("/tmp/rlhf-demo-ray"), ignore_errors=True)
    if not quiet:
        console.print("control plane stopped; logs were in .demo/")


def wait_http(url: str, timeout: float, what: str, proc: subprocess.Popen[bytes], log: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise DemoError(f"{what} exited ({proc.returncode}); see .demo/{log}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise DemoError(f"timed out after {timeout:.0f}s waiting for {what}; see .demo/{log}")


# ------------------------------------------------------------------------------------------ live view


def get_job() -> dict[str, Any] | None:
    proc = subprocess.run(
        ["kubectl", "get", "rlhfjob", JOB, "-n", NAMESPACE, "-o", "json"],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=30,
    )
    return json.loads(proc.stdout) if proc.returncode == 0 else None


def render(job: dict[str, Any] | None, started: float) -> Group:
    st = (job or {}).get("status", {})
    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    phase = st.get("phase") or "Pending"
    colour = {"Succeeded": "green", "Failed": "red", "Stalled": "yellow", "Restarting": "yellow"}.get(
        phase, "cyan"
    )
    head.add_row("RLHFJob", f"{NAMESPACE}/{JOB}   [dim]elapsed {time.monotonic() - started:.0f}s[/]")
    head.add_row("phase", f"[{colour}]{phase}[/]  {st.get('message', '')}")
    head.add_row(
        "step",
        f"{st.get('step', 0)}/{st.get('totalSteps', '?')}"
        + (f"   now in [bold]{st['currentPhase']}[/]" if st.get("currentPhase") else ""),
    )
    reward = st.get("rewardMean")
    head.add_row("reward", f"{reward:.3f}" if isinstance(reward, (int, float)) else "-")
    share = st.get("generationShare")
    head.add_row("generation share", f"{share:.0%}" if isinstance(share, (int, float)) else "-")
    tps = st.get("tokensPerSecond")
    head.add_row("tokens/s", f"{tps:.0f}" if isinstance(tps, (int, float)) else "-")
    head.add_row("engines", f"{(st.get('rollout') or {}).get('readyEngines', 0)} ready")
    phases = Table(title="last step, seconds per phase", title_justify="left", expand=False)
    phases.add_column("phase")
    phases.add_column("seconds", justify="right")
    phases.add_column("share", justify="right")
    phases.add_column("")
    secs: dict[str, float] = st.get("phaseSeconds") or {}
    total = sum(secs.values()) or 1.0
    for name, value in sorted(secs.items(), key=lambda kv: -kv[1]):
        bar = "█" * max(0, round(30 * value / total))
        phases.add_row(name, f"{value:.2f}", f"{value / total:.0%}", f"[magenta]{bar}[/]")
    return Group(Panel(head, title="rlhf-operator demo", border_style=colour), phases)


def follow(started: float, operator: subprocess.Popen[bytes] | None) -> dict[str, Any]:
    deadline = time.monotonic() + TIMEOUT
    job = get_job()
    shown_pods = False
    with Live(render(job, started), console=console, refresh_per_second=2, transient=False) as live:
        while time.monotonic() < deadline:
            if operator is not None and operator.poll() is not None:
                raise DemoError(f"the operator exited ({operator.returncode}); see .demo/operator.log")
            job = get_job()
            live.update(render(job, started))
            phase = ((job or {}).get("status") or {}).get("phase")
            if phase == "Running" and REAL_NODE and not shown_pods:
                shown_pods = True  # where the pods run, once, while they run
                pods = run("kubectl", "get", "pods", "-n", NAMESPACE, "-o", "wide", quiet=True)
                live.console.print(
                    f"[bold]the job's pods[/] (kubectl get pods -o wide):\n{pods.rstrip()}", highlight=False
                )
            if phase in ("Succeeded", "Failed"):
                return job or {}
            time.sleep(1)
    raise DemoError(f"the job did not finish within {TIMEOUT:.0f}s; see .demo/operator.log")


def summary(job: dict[str, Any], started: float) -> None:
    st = job.get("status", {})
    console.rule("[bold]summary")
    console.print(
        f"RLHFJob {NAMESPACE}/{JOB}: [bold]{st.get('phase')}[/] after {st.get('step')} steps "
        f"({time.monotonic() - started:.0f}s from apply), {st.get('restarts', 0)} restarts"
    )
    console.print(f"final mean reward {st.get('rewardMean')}, generation share {st.get('generationShare')}")
    ckpts = sorted(p.name for p in (TINY / "checkpoints").glob("step-*"))
    console.print(f"checkpoints in {TINY / 'checkpoints'}: {', '.join(ckpts) or 'none'}")
    events = run(
        "kubectl",
        "get",
        "events",
        "-n",
        NAMESPACE,
        "--field-selector",
        f"involvedObject.kind=RLHFJob,involvedObject.name={JOB}",
        "--sort-by=.lastTimestamp",
        quiet=True,
    )
    console.print(events.rstrip(), highlight=False)


# ----------------------------------------------------------------------------------------------- main


def build_side_by_side() -> str:
    """The control plane's binaries (only what `up` runs: the test-only ones are `make test`'s) and, for
    the real node, the images, side by side, with a progress line every 30 s and the time left. Returns
    the images' build output ("" without the real node)."""
    plans = {"Go builds": plan_seconds(sys.executable, "devcluster/devcluster.py", "build", "up", "--plan",
                                       key="build-plan-seconds")}  # fmt: skip
    images = None
    if REAL_NODE:
        plans["images"] = plan_seconds(
            sys.executable, "images/build_images.py", "plan", key="images-plan-seconds"
        )
        images = Background("images", sys.executable, "images/build_images.py", "all", "--keep-runtime")
    with Estimate(plans) as estimate:
        try:
            run_live(sys.executable, "devcluster/devcluster.py", "build", "up", timeout=5400)
        except BaseException:
            if images is not None:
                images.proc.kill()  # a failed or interrupted demo leaves no build behind
            raise
        estimate.done("Go builds")
        out = images.join() if images is not None else ""
        estimate.done("images")
    return out


def real_pods(t_all: float, out: str) -> int:
    """Steps 2-5 the way users run it: images built here, the operator in its pod, the job in pods."""
    t0 = step("2/5 make images: the operator and CPU trainer images, built here (no registry), beside step 1")
    refs = dict(
        line.split(": ", 1)
        for line in out.splitlines()
        if line.endswith(tuple("0123456789abcdef")) and "-image: " in line
    )
    operator_ref, trainer_ref = refs.get("operator-image", ""), refs.get("trainer-image", "")
    if not operator_ref or not trainer_ref:
        raise DemoError(f"make images did not name both images:\n{out[-2000:]}")
    done(t0, f"{operator_ref}, {trainer_ref}")

    t0 = step("3/5 helm install charts/rlhf-operator with those images")
    op_repo, op_tag = operator_ref.rsplit(":", 1)
    tr_repo, tr_tag = trainer_ref.rsplit(":", 1)
    run(
        "helm", "upgrade", "--install", RELEASE, "charts/rlhf-operator", "--namespace", "rlhf-system",
        "--create-namespace", "--wait", "--timeout", "5m",
        "--set", f"image.repository={op_repo}", "--set", f"image.tag={op_tag}",
        "--set", f"jobDefaults.trainerImage.repository={tr_repo}", "--set", f"jobDefaults.trainerImage.tag={tr_tag}",
        "--set", "jobDefaults.gpuStandIn=cpu",  # the node's nvidia.com/gpu is advertised, not real
        "--set", "nodeSelector.rlhf\\.dev/node=real",
        "--set", "tolerations[0].key=rlhf.dev/real-node", "--set", "tolerations[0].operator=Exists",
    )  # fmt: skip
    run("kubectl", "get", "pods", "-n", "rlhf-system", "-o", "wide")
    done(t0, "the operator runs in its pod (uid 10001, read-only root, its own ServiceAccount)")

    t0 = step("4/5 kubectl apply -f examples/rlhf-tiny-volume.yaml -f examples/rlhfjob-tiny-pods.yaml")
    shutil.rmtree(TINY / "checkpoints", ignore_errors=True)  # a fresh run, not a resume of the last demo
    if not (TINY / "model" / "config.json").exists():
        run(str(VENV_BIN / "rlhf"), "make-tiny-model", str(TINY))
    for path in [TINY, *TINY.rglob("*")]:
        os.chown(path, TRAINER_UID, TRAINER_UID)
    run(
        "kubectl", "delete", "pv", "rlhf-tiny", "--ignore-not-found", quiet=True
    )  # a Released one from before
    run("kubectl", "apply", "-f", "examples/rlhf-tiny-volume.yaml", "-f", "examples/rlhfjob-tiny-pods.yaml")
    started = time.monotonic()
    return finish(follow(started, None), started, t_all)


def finish(job: dict[str, Any], started: float, t_all: float) -> int:
    """Step 5: the job's row, the summary, and the verdict (the exit code)."""
    run("kubectl", "get", "rlhf", "-n", NAMESPACE, "-o", "wide")
    summary(job, started)
    ok = job.get("status", {}).get("phase") == "Succeeded"
    console.rule("[bold]5/5 done")
    console.print(
        f"[{'green' if ok else 'red'}]demo {'succeeded' if ok else 'FAILED'}[/] in {time.monotonic() - t_all:.0f}s"
    )
    return 0 if ok else 1


def main() -> int:
    DEMO.mkdir(exist_ok=True)
    cleanup(quiet=True)  # whatever an interrupted run left behind
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    t_all = time.monotonic()
    try:
        t0 = step("1/5 local control plane (built once from the Go module proxy, then cached)")
        images = build_side_by_side()
        run_live(sys.executable, "devcluster/devcluster.py", "up", timeout=1800)
        done(
            t0,
            "etcd, kube-apiserver, controller-manager, scheduler, KWOK (2 fake 8-GPU nodes), KubeRay"
            + (
                ", and the real node rlhf-node-0 (kubelet, containerd, kube-proxy, CoreDNS)"
                if REAL_NODE
                else ""
            ),
        )
        if REAL_NODE:
            return real_pods(t_all, images)

        t0 = step("2/5 helm install charts/rlhf-operator")
        run(
            "helm",
            "upgrade",
            "--install",
            RELEASE,
            "charts/rlhf-operator",
            "--namespace",
            "rlhf-system",
            "--create-namespace",
            "--wait",
            "--timeout",
            "3m",
        )
        run("kubectl", "get", "crd", "rlhfjobs.rlhf.dev")
        done(t0, "chart installed: CRD, RBAC, Deployment (fake-Running on KWOK), metrics Service")

        t0 = step("3/5 local Ray head and the operator")
        shutil.rmtree(TINY / "checkpoints", ignore_errors=True)  # a fresh run, not a resume of the last demo
        if not (TINY / "model" / "config.json").exists():
            run(str(VENV_BIN / "rlhf"), "make-tiny-model", str(TINY))
        ray = spawn(
            "ray-head",
            [
                str(VENV_BIN / "ray"),
                "start",
                "--head",
                "--block",
                f"--port={RAY_PORT}",
                "--dashboard-host=127.0.0.1",
                f"--dashboard-port={DASHBOARD_PORT}",
                "--num-cpus=16",
                "--num-gpus=16",  # logical GPUs: the jobs' whole-GPU placement, under the CPU stand-in
                "--disable-usage-stats",
                "--temp-dir=/tmp/rlhf-demo-ray",
                "--min-worker-port=31000",
                "--max-worker-port=31999",
            ],
        )
        wait_http(f"http://127.0.0.1:{DASHBOARD_PORT}/api/version", 180, "the Ray head", ray, "ray-head.log")
        operator = spawn(
            "operator",
            [str(VENV_BIN / "rlhf"), "operator", "--all-namespaces"],
            {
                "RLHF_DEV_HEAD_HOST": "127.0.0.1",
                "RLHF_DEV_DASHBOARD_PORT": str(DASHBOARD_PORT),
                "RLHF_OPERATOR_METRICS_PORT": "0",
                "RLHF_RECONCILE_INTERVAL": "1",
                "RLHF_GPU_STANDIN": "cpu",  # KWOK's GPUs are advertised, not real
            },
        )
        done(
            t0,
            f"Ray head on :{RAY_PORT} (dashboard :{DASHBOARD_PORT}); operator pid {operator.pid}, "
            "log .demo/operator.log",
        )

        t0 = step("4/5 kubectl apply -f examples/rlhfjob-tiny.yaml")
        run("kubectl", "apply", "-n", NAMESPACE, "-f", "examples/rlhfjob-tiny.yaml")
        started = time.monotonic()
        return finish(follow(started, operator), started, t_all)
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/]")
        return 130
    except DemoError as e:
        console.print(f"[red]error:[/] {e}")
        return 1
    finally:
        cleanup()


if __name__ == "__main__":
    sys.exit(main())
