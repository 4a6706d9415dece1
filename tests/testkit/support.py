"""Helpers for tests against the local control plane: kubectl/helm wrappers, polling, the local Ray
head and the operator as a local process. Fixtures that use them live in conftest.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = ROOT / ".venv" / "bin"
CRD_FILE = ROOT / "crds" / "rlhfjobs.rlhf.dev.yaml"
RAY_PORT = 16379
RAY_DASHBOARD_PORT = 18265

T = TypeVar("T")
UNREACHABLE_GRACE_S = 90.0
# kubectl's words for a request that did not reach the API server (so sending it again is safe).
_NEVER_REACHED = ("Unable to connect to the server", "was refused - did you specify", "TLS handshake timeout")


def never_reached(stderr: str) -> bool:
    """Whether kubectl failed before its request reached the API server."""
    return any(words in stderr for words in _NEVER_REACHED)


@dataclass
class Cluster:
    """Handles to the running control plane: kubeconfig, binaries, and small helpers over kubectl/helm."""

    kubeconfig: Path
    bin_dir: Path

    @property
    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "KUBECONFIG": str(self.kubeconfig),
            "PATH": f"{self.bin_dir}:{os.environ['PATH']}",
        }

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        # A request that never reached the API server is sent again, for up to UNREACHABLE_GRACE_S: on this
        # 2-core machine a real node starting Ray and vLLM pods can starve the API server past kubectl's
        # 10 s TLS handshake timeout (a CI run failed that way), and nothing was applied or read.
        deadline = time.monotonic() + UNREACHABLE_GRACE_S
        while True:
            proc = subprocess.run(
                [str(self.bin_dir / "kubectl"), *args],
                input=input,
                capture_output=True,
                text=True,
                env=self.env,
                timeout=timeout,
            )
            if proc.returncode == 0 or not never_reached(proc.stderr) or time.monotonic() > deadline:
                break
            time.sleep(2)
        if check and proc.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}")
        return proc

    def helm(self, *args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            [str(self.bin_dir / "helm"), "--kubeconfig", str(self.kubeconfig), *args],
            capture_output=True,
            text=True,
            env=self.env,
            timeout=timeout,
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}")
        return proc

    def apply(self, obj: dict[str, Any], namespace: str | None = None) -> None:
        ns = ["-n", namespace] if namespace else []
        self.kubectl("apply", *ns, "-f", "-", input=json.dumps(obj))

    def get(self, kind: str, name: str, namespace: str | None = None) -> dict[str, Any] | None:
        ns = ["-n", namespace] if namespace else []
        proc = self.kubectl("get", kind, name, *ns, "-o", "json", check=False)
        if proc.returncode != 0:
            if "NotFound" in proc.stderr or "not found" in proc.stderr:
                return None
            raise AssertionError(f"kubectl get {kind} {name}: {proc.stderr}")
        obj: dict[str, Any] = json.loads(proc.stdout)
        return obj

    def list(
        self, kind: str, namespace: str | None = None, selector: str | None = None
    ) -> list[dict[str, Any]]:
        args = ["get", kind, "-o", "json"]
        args += ["-n", namespace] if namespace else ["-A"]
        if selector:
            args += ["-l", selector]
        items: list[dict[str, Any]] = json.loads(self.kubectl(*args).stdout)["items"]
        return items


class PhaseWatch:
    """Every `status.phase` an object's versions carried, in order, from a `kubectl get --watch` stream.

    A watch delivers each version the API server stored, so a phase held for a moment between two polls
    is still seen (a poll can miss it). A watch the API server drops is started again; its first line is
    the object as it is then, so a phase can be missed only while no watch is open.
    """

    def __init__(self, cluster: Cluster, kind: str, name: str, namespace: str) -> None:
        self.phases: list[str] = []
        self.restarts = 0
        self._argv = [
            str(cluster.bin_dir / "kubectl"), "get", kind, name, "-n", namespace, "--watch",
            "-o", "jsonpath={.status.phase}{\"\\n\"}",
        ]  # fmt: skip
        self._env = cluster.env
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._proc = self._start()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _start(self) -> subprocess.Popen[str]:
        return subprocess.Popen(
            self._argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=self._env
        )

    def _read(self) -> None:
        while True:
            assert self._proc.stdout is not None
            for line in self._proc.stdout:
                phase = line.strip()
                if phase and (not self.phases or self.phases[-1] != phase):
                    self.phases.append(phase)
            self._proc.wait()
            if self._stopping.wait(1):
                return
            with self._lock:
                if self._stopping.is_set():
                    return
                self.restarts += 1
                self._proc = self._start()

    def stop(self) -> list[str]:
        with self._lock:
            self._stopping.set()
            self._proc.terminate()
        self._proc.wait(10)
        self._thread.join(10)
        return self.phases


def wait_for(fn: Callable[[], T | None], timeout: float, what: str, interval: float = 0.5) -> T:
    """Poll fn until it returns something truthy; fail naming what we waited for and the last value."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while time.monotonic() < deadline:
        last = fn()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; last value: {last!r}")


def _dashboard_up(port: int = RAY_DASHBOARD_PORT) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/version", timeout=2) as r:
            return bool(r.status == 200)
    except OSError:
        return False


@dataclass
class RayHead:
    """The local Ray head that stands in for a RayCluster's head pod (docs/development.md)."""

    address: str
    dashboard_url: str


class OperatorProcess:
    """`rlhf operator` as a local process pointed at the control plane, with the dev head override.

    It watches every namespace unless `namespaces` names some: then it never acts on another test's jobs.
    """

    def __init__(
        self,
        cluster: Cluster,
        log_path: Path,
        extra_env: dict[str, str] | None = None,
        namespaces: list[str] | None = None,
    ) -> None:
        self.cluster = cluster
        self.log_path = log_path
        self.extra_env = extra_env or {}
        self.scope = (
            [a for ns in namespaces for a in ("--namespace", ns)] if namespaces else ["--all-namespaces"]
        )
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, **env: str) -> None:
        assert self.proc is None or self.proc.poll() is not None, "operator already running"
        full_env = {
            **self.cluster.env,
            "RLHF_DEV_HEAD_HOST": "127.0.0.1",
            "RLHF_DEV_DASHBOARD_PORT": str(RAY_DASHBOARD_PORT),
            "RLHF_OPERATOR_METRICS_PORT": "0",
            "RLHF_RECONCILE_INTERVAL": "1",
            # KWOK's nvidia.com/gpu is advertised, not real: the named CPU stand-in (docs/gpu-cluster.md).
            "RLHF_GPU_STANDIN": "cpu",
            **self.extra_env,
            **env,
        }
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            [str(VENV_BIN / "rlhf"), "operator", *self.scope, "--verbose"],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=full_env,
            start_new_session=True,
        )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        if self.alive():
            assert self.proc is not None
            self.proc.kill()
            self.proc.wait(30)

    def stop(self) -> None:
        if self.alive():
            assert self.proc is not None
            terminate(self.proc)

    def log_tail(self, lines: int = 40) -> str:
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def drop_rlhfjobs(cluster: Cluster, namespace: str) -> None:
    """Delete every RLHFJob of `namespace` once no operator acts on it any more.

    The operator's reconcile timer puts kopf's finalizer on each job, and only a running operator takes it
    off: a job left behind holds its namespace's deletion (Terminating) until some later test's operator
    comes by. With no operator left, nothing else waits on that finalizer: take it off, then delete.
    """
    names = cluster.kubectl("get", "rlhfjobs", "-n", namespace, "-o", "name", check=False).stdout.split()
    for name in names:
        unfinalized = '{"metadata":{"finalizers":null}}'
        cluster.kubectl("patch", name, "-n", namespace, "--type=merge", "-p", unfinalized, check=False)
    if names:
        cluster.kubectl("delete", *names, "-n", namespace, "--wait=false", check=False)


def terminate(proc: subprocess.Popen[bytes], grace: float = 30) -> None:
    """SIGTERM, then SIGKILL if the process has not exited within `grace` seconds."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def _alive(pid: int) -> bool:
    """Whether `pid` runs: a zombie (exited, not yet reaped by its parent) does not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(OSError):
        if Path(f"/proc/{pid}/stat").read_text().split(")", 1)[1].split()[0] == "Z":
            return False
    return True


def stop_ray_start(proc: subprocess.Popen[bytes] | int, grace: float = 30) -> None:
    """Stop a `ray start --block` started in its own process group (start_new_session), and its node: our
    child (its Popen) or not (its pid: `make test`'s shared head, started by another process).

    SIGTERM goes to the `ray start` process alone: it drains its node through the GCS and stops its
    children (2.3 s measured, 2026-11-29). Sent to the whole group, the GCS dies at once and the drain
    waits its 30 s for it (33.6 s measured), which every stage with a Ray head paid at its end. Whatever
    of the group outlives `grace` is SIGKILLed."""
    pid = proc if isinstance(proc, int) else proc.pid
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    if not isinstance(proc, int):
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)  # reap it


def rollout_group_replicas(raycluster: dict[str, Any]) -> int | None:
    """The replicas of a RayCluster's `rollout` worker group (None when it has none)."""
    for group in raycluster.get("spec", {}).get("workerGroupSpecs", []):
        if group.get("groupName") == "rollout":
            return int(group.get("replicas", 0))
    return None


def rollout_replicas(cluster: Cluster, ns: str, name: str) -> int | None:
    """The replicas of the RayCluster `name`'s `rollout` worker group (None without the RayCluster or group)."""
    rc = cluster.get("raycluster", name, ns)
    return rollout_group_replicas(rc) if rc else None


# Arms the trainer's start-up fault (rlhf_trainer.faults): every attempt fails at once, exiting 1 like a
# crash, so the operator restarts it. The tests' fast restartable failure (spec.pods.env).
START_FAULT = {"name": "RLHF_TRAINER_FAULTS", "value": "start@0"}


def stall_events(cluster: Cluster, namespace: str, name: str) -> list[dict[str, Any]]:
    """The `Stalled` Events the operator recorded for the RLHFJob `name`."""
    return [
        e
        for e in cluster.list("events", namespace)
        if e["involvedObject"].get("name") == name and e["reason"] == "Stalled"
    ]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# What every rank imports: the fork server imports it once, so a rank starts in a fraction of a second
# instead of paying ~5 CPU-seconds of imports (about 20 ranks in the unit stage).
RANK_PRELOAD = ["torch", "deepspeed", "transformers"]


def rank_context() -> Any:
    """The multiprocessing context `run_ranks` starts ranks in (and their queues come from): a fork server
    that imported RANK_PRELOAD once, started on first use. Nothing has computed in it, so no thread pool
    is copied into a rank; a rank is forked from it, not from the test process."""
    import multiprocessing as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(RANK_PRELOAD)
    return ctx


def _rank_in_env(env: dict[str, str], target: Callable[..., None], rank: int, *args: Any) -> None:
    """A rank under the caller's environment at the time of `run_ranks` (the fork server has the one of
    its own start), torch's thread count included (read from OMP_NUM_THREADS only at import)."""
    os.environ.clear()
    os.environ.update(env)
    if env.get("OMP_NUM_THREADS", "").isdigit():
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    target(rank, *args)


def run_ranks(target: Callable[..., None], world: int, args: tuple[Any, ...], timeout: float) -> None:
    """Run `target(rank, *args)` in `world` processes (rank_context) and fail unless each exits 0 in time.

    A rank still alive at the deadline is killed: a hung one left behind would keep the pytest process
    from exiting (multiprocessing joins its children at exit) and load the cores of every later test.
    """
    ctx = rank_context()
    env = dict(os.environ)
    procs = [
        ctx.Process(target=_rank_in_env, args=(env, target, r, *args), daemon=True) for r in range(world)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(10)
    assert codes == [0] * world, (
        f"{world}-rank run: a rank failed or hung past {timeout:.0f} s (exit codes {codes}; None = killed)"
    )


def tiny_policy(out: Path) -> Any:
    """The tiny Llama built under `out`, loaded as a float32 causal LM in eval mode: the real model the
    trainer's forward, packing and log-prob tests run on."""
    import torch
    from rlhf_trainer.tiny_model import make_tiny_model
    from transformers import AutoModelForCausalLM

    make_tiny_model(out)
    loaded: Any = AutoModelForCausalLM.from_pretrained(str(out / "model"), dtype=torch.float32)
    return loaded.eval()


def tiny_critic(model_dir: Path, out: Path) -> Path:
    """A token-classification critic (one label, seed 5) built from the tiny model, saved under out/critic,
    for the unit tests that start real ZeRO-3 ranks with a critic."""
    import torch
    from transformers import AutoModelForTokenClassification

    torch.manual_seed(5)
    critic = out / "critic"
    AutoModelForTokenClassification.from_pretrained(model_dir, num_labels=1).save_pretrained(critic)
    return critic


def example_job(name: str, **overrides: Any) -> dict[str, Any]:
    """examples/rlhfjob-tiny.yaml as written, named `name`, with `overrides` set by dotted path
    (`**{"spec.runPolicy.backoffLimit": 0}`): a job the operator renders, whose trainer need not run."""
    import yaml

    doc: dict[str, Any] = yaml.safe_load((ROOT / "examples" / "rlhfjob-tiny.yaml").read_text())
    doc["metadata"] = {"name": name}
    return set_dotted(doc, overrides)


def set_dotted(doc: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Set each `a.b.c: value` of `overrides` in `doc` (missing levels made), and return `doc`."""
    for path, value in overrides.items():
        node = doc
        keys = path.split(".")
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = value
    return doc


def tiny_job(
    name: str, model: Path, ckpt: Path, steps: int, *, lean: bool = False, **spec: Any
) -> dict[str, Any]:
    """examples/rlhfjob-tiny.yaml on the tiny model in `model`, `steps` steps, a free metrics port.

    The example is PPO on three ZeRO-3 ranks (two actor+reference, one critic) and one engine. `lean`:
    GRPO on one actor+reference rank and no critic, the cheapest real trainer (measured 2026-11-29, 6
    steps with its own Ray: 37.7 s and 57 CPU-seconds against the example's 50.3 s and 85), for tests
    that prove what the operator does with a real trainer (restarts, resumes, deadlines, alerts), not
    PPO or ZeRO-3 across ranks: those are proved by the trainer stage's runs, the realnode run and the
    demo, all on the example's shape. Lean runs export nothing (`checkpoint.export: never`, 5-9 s less
    at each success): the export is proved by the trainer stage's runs and the realnode run. Sections in
    `spec` are merged over the lean shape."""
    import yaml

    doc: dict[str, Any] = yaml.safe_load((ROOT / "examples" / "rlhfjob-tiny.yaml").read_text())
    doc["metadata"] = {"name": name}
    s = doc["spec"]
    s["model"]["actor"] = s["model"]["critic"] = str(model / "model")
    s["data"]["prompts"] = str(model / "prompts.jsonl")
    s["checkpoint"].update(path=str(ckpt), intervalSteps=steps)
    s["algorithm"]["totalSteps"] = steps
    s["monitoring"].update(metricsPort=free_port(), scrapeIntervalSeconds=1)
    if lean:
        s["algorithm"]["advantageEstimator"] = "grpo"
        del s["model"]["critic"], s["trainer"]["critic"]
        s["trainer"]["actor"] = {**s["trainer"]["actor"], "gpusPerNode": 1}
        s["checkpoint"]["export"] = "never"
    for key, value in spec.items():
        s[key] = {**s.get(key, {}), **value}
    return doc


def submit_standin_trainer(cluster: Cluster, namespace: str, name: str, command: str = "sleep 900") -> str:
    """Submit `command` as the STAND-IN TRAINER of the RLHFJob `namespace/name`'s first attempt: a Ray job
    on the local head under the submission id the operator will use, so it adopts it as its trainer and
    starts no real one. For tests where the operator's handling is what is proved, not the trainer (its
    succeeding or failing follows the command's exit). Fails if that id already exists: the operator
    submitted first, so the test would run a real trainer it was not sized for."""
    from rlhf_api.spec import RLHFJob
    from rlhf_operator import manifests

    obj = cluster.get("rlhfjob", name, namespace)
    assert obj is not None, f"no RLHFJob {namespace}/{name}"
    sid = manifests.submission_id(RLHFJob.model_validate(obj), obj["metadata"]["uid"], 0)
    resp = httpx.post(
        f"http://127.0.0.1:{RAY_DASHBOARD_PORT}/api/jobs/",
        json={"entrypoint": command, "submission_id": sid, "metadata": {"stand-in": "trainer"}},
        timeout=30,
    )
    assert resp.status_code in (200, 201), (
        f"stand-in trainer for {name} not submitted (the operator's own submission first?): "
        f"HTTP {resp.status_code}: {resp.text[:300]}"
    )
    return sid


def audited_creates(resource: str, namespace: str, name: str) -> list[dict[str, Any]]:
    """The successful creates of `resource` `namespace/name` in the API server's audit log, in order.

    The dev cluster's kube-apiserver audits every write at Metadata level (devcluster.py); a create that
    the API server refused (409 AlreadyExists) is not a create. The log is the API server's own record,
    so a count from it cannot miss an object that existed between two polls. One caveat: a create whose
    client died mid-request can be stored and still be audited as failed (504, context canceled).
    """
    return [
        ev
        for ev in audited("create", resource, namespace, name)
        if 200 <= int(ev.get("responseStatus", {}).get("code", 0)) < 300
    ]


def audited(verb: str, resource: str, namespace: str, name: str) -> list[dict[str, Any]]:
    """Every `verb` request on `resource` `namespace/name` (not a subresource) the API server completed,
    whatever its answer, from the audit log, in order."""
    import devcluster

    logs = devcluster.STATE / "logs"
    parts = sorted(logs.glob("audit*.log"))
    if not parts:
        raise AssertionError(f"no audit log in {logs}: is this the dev cluster's kube-apiserver?")
    out = []
    for path in parts:  # a rotated part (audit-<time>.log) too
        with path.open(errors="replace") as f:
            for line in f:
                if f'"{resource}"' not in line or f'"{verb}"' not in line:
                    continue
                ev = json.loads(line)
                ref = ev.get("objectRef", {})
                if (
                    ev.get("verb") == verb
                    and ev.get("stage") == "ResponseComplete"
                    and (ref.get("resource"), ref.get("namespace"), ref.get("name"))
                    == (resource, namespace, name)
                    and not ref.get("subresource")
                ):
                    out.append(ev)
    return sorted(out, key=lambda ev: str(ev.get("stageTimestamp")))


def ray_job_logs(submission_id: str) -> str:
    resp = httpx.get(f"http://127.0.0.1:{RAY_DASHBOARD_PORT}/api/jobs/{submission_id}/logs", timeout=10)
    resp.raise_for_status()
    return str(resp.json()["logs"])


def step_reports(logs: str) -> list[dict[str, Any]]:
    """The driver's one-JSON-object-per-step lines from a Ray job log, in order.

    Ray's log monitor sometimes glues a worker's deduplicated line (it lacks a newline) in front of the
    driver's next line, so a report can start mid-line: look for it anywhere in the line.
    """
    reports = []
    for line in logs.splitlines():
        at = line.find('{"step":')
        if at >= 0:
            reports.append(json.loads(line[at:]))
    return reports


class MetricsWatcher:
    """Scrapes a /metrics URL every `interval` seconds in a thread; keeps every scrape's text."""

    def __init__(self, url: str, interval: float = 1.0) -> None:
        self.url = url
        self.interval = interval
        self.scrapes: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                with urllib.request.urlopen(self.url, timeout=2) as r:
                    self.scrapes.append(r.read().decode())
            except OSError:
                pass
            self._stop.wait(self.interval)

    def stop(self) -> list[str]:
        self._stop.set()
        self._thread.join(timeout=5)
        return self.scrapes


def metric_samples(text: str) -> list[Any]:
    """Every sample of a /metrics text, parsed by prometheus_client's own parser."""
    from prometheus_client.parser import text_string_to_metric_families

    return [s for fam in text_string_to_metric_families(text) for s in fam.samples]


def metric_value(text: str, name: str, **labels: str) -> float:
    """The value of the first sample named `name` whose labels include `labels`; KeyError if none."""
    for s in metric_samples(text):
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
            return float(s.value)
    raise KeyError(name)


# Every series name of the trainer's metrics contract (docs/monitoring.md), written out independently of the code.
METRICS_CONTRACT = [
    "rlhf_step_seconds",
    "rlhf_step_phase_seconds",
    "rlhf_phase_duration_seconds_bucket",
    "rlhf_phase_in_progress",
    "rlhf_phase_started_timestamp_seconds",
    "rlhf_steps_completed_total",
    "rlhf_last_step_completed_timestamp_seconds",
    "rlhf_total_steps",
    "rlhf_stall_timeout_seconds",
    "rlhf_generated_tokens_total",
    "rlhf_trained_tokens_total",
    "rlhf_reward_mean",
    "rlhf_kl",
    "rlhf_reward_errors_total",
    "rlhf_weight_sync_bytes_total",
    "rlhf_weight_sync_buckets_total",
    "rlhf_weight_sync_digest_mismatches_total",
    "rlhf_rollout_engines",
    "rlhf_last_checkpoint_step",
    "rlhf_sample_staleness_bucket",
    "rlhf_trainer_idle_ratio",
    "rlhf_rollout_idle_ratio",
    "rlhf_stale_samples_total",
    "rlhf_dynamic_sampling_groups_total",
    "rlhf_dynamic_sampling_rounds_total",
    "rlhf_kl_coef",
    "rlhf_entropy",
    "rlhf_logprob_gap",
]


# ------------------------------------------------------------------------------------------- device maps

DeviceRow = tuple[str, str, tuple[int, ...]]  # (process, pod, Ray GPU ids)


def device_map_rows(text: str) -> list[DeviceRow]:
    """The rows of the device-map table (rlhf_trainer.device_plan.table) in a log or in `rlhf plan`'s
    output: the first table found, from its PROCESS header to the first line that is not a row."""
    rows: list[DeviceRow] = []
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.split()[:2] == ["PROCESS", "ROLES"]), None)
    if start is None:
        return rows
    for line in lines[start + 1 :]:
        parts = line.split()
        if len(parts) < 5 or not (parts[3] == "-" or parts[3].replace(",", "").isdigit()):
            break
        gpus = () if parts[3] == "-" else tuple(int(g) for g in parts[3].split(","))
        rows.append((parts[0], parts[2], gpus))
    return rows


def device_map_shape(
    rows: list[DeviceRow],
) -> tuple[frozenset[frozenset[str]], frozenset[frozenset[str]], dict[str, int]]:
    """A map up to pod names and GPU numbering: which processes share a pod, which share a GPU, and each
    process's GPU count. Two placements of one plan on pods of one shape have the same shape."""
    by_pod: dict[str, set[str]] = {}
    by_gpu: dict[tuple[str, int], set[str]] = {}
    for name, pod, gpus in rows:
        by_pod.setdefault(pod, set()).add(name)
        for g in gpus:
            by_gpu.setdefault((pod, g), set()).add(name)
    return (
        frozenset(frozenset(v) for v in by_pod.values()),
        frozenset(frozenset(v) for v in by_gpu.values()),
        {name: len(gpus) for name, _, gpus in rows},
    )


def failing_job(name: str, **overrides: Any) -> dict[str, Any]:
    """A job whose trainer fails at start-up in every attempt, as a crash (restartable)."""
    return example_job(name, **{"spec.pods.env": [START_FAULT], **overrides})


def job_status(cluster: Cluster, ns: str, name: str) -> dict[str, Any]:
    obj = cluster.get("rlhfjob", name, ns)
    return dict((obj or {}).get("status", {}))


def phase_is(cluster: Cluster, ns: str, name: str, *phases: str) -> dict[str, Any] | None:
    """The job's status when its phase is one of `phases`, else None (for wait_for)."""
    st = job_status(cluster, ns, name)
    return st if st.get("phase") in phases else None


def condition(st: dict[str, Any], kind: str) -> dict[str, Any]:
    """The condition of type `kind` in the status `st` ({} when it has none)."""
    return next((c for c in st.get("conditions") or [] if c.get("type") == kind), {})


def events(cluster: Cluster, ns: str, name: str) -> list[dict[str, Any]]:
    """The Events recorded for the RLHFJob `name`."""
    return [
        e
        for e in cluster.list("events", ns)
        if e.get("involvedObject", {}).get("kind") == "RLHFJob" and e["involvedObject"].get("name") == name
    ]


def ray_submissions(prefix: str) -> list[str]:
    """Submission ids on the local Ray head that start with `prefix`."""
    resp = httpx.get(f"http://127.0.0.1:{RAY_DASHBOARD_PORT}/api/jobs/", timeout=10)
    resp.raise_for_status()
    return [j["submission_id"] for j in resp.json() if str(j.get("submission_id", "")).startswith(prefix)]


# ---- the manifest corpus: tests/data/invalid (each file's header says what must refuse it) and examples/

INVALID_MANIFESTS = sorted((ROOT / "tests" / "data" / "invalid").glob("*.yaml"))
EXAMPLE_JOBS = sorted((ROOT / "examples").glob("rlhfjob-*.yaml"))  # RLHFJobs (not the volume example)
# ClusterRLHFRuntimes and RLHFRuntimes, apart: they are not jobs. A job example names one in runtimeRef.
EXAMPLE_RUNTIMES = sorted((ROOT / "examples" / "runtimes").glob("*.yaml"))


def example_runtime(job: Path) -> Path | None:
    """The runtime example (examples/runtimes/<name>.yaml) a job example names in spec.runtimeRef."""
    ref = (yaml.safe_load(job.read_text()).get("spec") or {}).get("runtimeRef")
    return ROOT / "examples" / "runtimes" / f"{ref['name']}.yaml" if ref else None


def manifest_header(path: Path) -> dict[str, str]:
    """The `# key: value` comment lines at the top of a test manifest (expect, rule, why)."""
    fields = {}
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        key, _, value = line.lstrip("# ").partition(":")
        fields[key.strip()] = value.strip()
    return fields


def minimal_job(name: str, **spec: Any) -> dict[str, Any]:
    """A valid RLHFJob with the given top-level spec sections added."""
    return {
        "apiVersion": "rlhf.dev/v1alpha1",
        "kind": "RLHFJob",
        "metadata": {"name": name},
        "spec": {
            "model": {"actor": "/models/a", "reward": {"type": "function", "function": "rewards:score"}},
            "data": {"prompts": "/data/p.jsonl"},
            **spec,
        },
    }
