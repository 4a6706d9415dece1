"""RLHFJobs at a steady rate on realistic KWOK GPU nodes: create -> RayCluster latency, writes, CPU, memory.

The real operator (`rlhf operator`, kopf) runs as a local process holding only a token of the chart's
ServiceAccount, bound by the chart's own RBAC, so the API server's audit log names it: every
create/update/patch/delete it makes is counted there, per job and per resource. The control plane is
the project's own (etcd, kube-apiserver, controller-manager, scheduler, KWOK, KubeRay) in its own
directory and ports, with KWOK nodes only. `--nodes N` adds N nodes shaped like a real 8-GPU machine
(without it: a few huge nodes, as before). RayCluster pods are KWOK pods (nothing runs in them), and a
stand-in Ray dashboard and trainer /metrics in a child process (the development head override,
docs/development.md) let every job reach its steady state, `Running`, without Ray. There is no peer
operator to compare against: the comparison is one job at a time on an idle operator vs `--jobs`
created at `--qps`, in the same run.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, cast

from lib import common, heap

ROOT = common.ROOT
# Our own control plane, never the one the tests use (.cluster, default ports), and KWOK nodes only:
# no RayCluster pod tolerates the real node's taint, so it would only cost start-up time and CPU.
os.environ.setdefault("RLHF_CLUSTER_DIR", "/tmp/bench-cluster")
os.environ.setdefault("RLHF_CLUSTER_PORT_OFFSET", "200")
# KubeRay reconciles one RayCluster at a time by default: with 1,000 new clusters that, not the RLHF
# operator, bounds the time until every job runs (about 0.3 clusters/s became ready here).
os.environ.setdefault("RLHF_KUBERAY_ARGS", "--reconcile-concurrency=8")
os.environ.setdefault("RLHF_REAL_NODE", "0")
sys.path.insert(0, str(ROOT / "devcluster"))
import devcluster  # noqa: E402  (reads RLHF_CLUSTER_DIR at import)

WORK = Path("/tmp/rlhf-bench-opscale")
STATE: Path = devcluster.STATE
OPERATOR_NS = "rlhf-system"
SOLO_NS, BURST_NS = "bench-solo", "bench-burst"
WRITE_VERBS = ("create", "update", "patch", "delete", "deletecollection")
GPU = "nvidia.com/gpu"
NOT_READY_TAINT = "node.kubernetes.io/not-ready"
BENCH_LABEL = ("rlhf.dev/bench", "operator-scale")
NODE_BASE = 100  # bench nodes are kwok-gpu-100, -101, ... (the control plane's own are kwok-gpu-0 and -1)
PROGRESS_EVERY = 10.0
Key = tuple[str, str]


@dataclass(frozen=True)
class NodeShape:
    """A fake node's capacity and allocatable (what the scheduler fits pods into)."""

    label: str
    capacity: dict[str, str]
    allocatable: dict[str, str]

    @property
    def gpus(self) -> int:
        return int(self.allocatable[GPU])

    @property
    def pods(self) -> int:
        return int(self.allocatable["pods"])


# Without --nodes: a few huge nodes (two unless the jobs need more), as this benchmark always had.
_BIG = {"cpu": "2000", "memory": "16Ti", "pods": "400", GPU: "400"}
BIG_NODE = NodeShape("big (400 GPUs, 400 pods)", _BIG, _BIG)
# With --nodes: a real 8-GPU machine (an AWS p4d.24xlarge: 96 vCPUs, 1152 GiB, 8 A100s), with the
# allocatable a kubelet leaves after its system reservations, and the kubelet's default 110 pods.
GPU_NODE = NodeShape(
    "8 GPUs, 96 CPUs, 1152 GiB, 110 pods",
    {"cpu": "96", "memory": "1152Gi", "ephemeral-storage": "7600Gi", "pods": "110", GPU: "8"},
    {"cpu": "95690m", "memory": "1120Gi", "ephemeral-storage": "7000Gi", "pods": "110", GPU: "8"},
)

# ---------------------------------------------------------------------------------------------- stand-in Ray


def trainer_metrics(started: float) -> str:
    """A trainer mid-run (step 3 of 20, generating), unchanging: any status write after the first scrape
    is the operator's own churn, not progress."""
    return "\n".join(
        [
            "rlhf_steps_completed_total 3",
            "rlhf_total_steps 20",
            f"rlhf_last_step_completed_timestamp_seconds {started:.3f}",
            "rlhf_stall_timeout_seconds 3600",
            'rlhf_step_phase_seconds{phase="generation"} 4.25',
            'rlhf_step_phase_seconds{phase="train"} 2.5',
            'rlhf_phase_in_progress{phase="generation"} 1',
            f'rlhf_phase_started_timestamp_seconds{{phase="generation"}} {started + 1:.3f}',
            "rlhf_generated_tokens_total 12288",
            "rlhf_trained_tokens_total 12288",
            "rlhf_reward_mean 0.45",
            "rlhf_kl 0.0012",
            'rlhf_rollout_engines{state="ready"} 1',
            "",
        ]
    )


def serve_stand_in(port: int) -> None:
    """The Ray Jobs REST API (submit, get, stop) and the trainer's /metrics, for every job at once."""
    jobs: dict[str, dict[str, Any]] = {}
    lock = threading.Lock()
    metrics_body = trainer_metrics(time.time()).encode()

    class Handler(BaseHTTPRequestHandler):
        def _reply(self, code: int, body: bytes, ctype: str = "application/json") -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            if self.path == "/metrics":
                self._reply(200, metrics_body, "text/plain; version=0.0.4")
                return
            sid = self.path.removeprefix("/api/jobs/").strip("/")
            with lock:
                job = jobs.get(sid)
            if job is None:
                self._reply(404, b'{"detail": "not found"}')
            else:
                self._reply(200, json.dumps(job).encode())

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
            if self.path.endswith("/stop"):
                self._reply(200, b'{"stopped": true}')
                return
            sid = str(body.get("submission_id"))
            with lock:
                jobs.setdefault(
                    sid,
                    {
                        "submission_id": sid,
                        "status": "RUNNING",
                        "message": "",
                        "start_time": time.time() * 1e3,
                    },
                )
            self._reply(200, json.dumps({"submission_id": sid}).encode())

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    print("READY", flush=True)
    server.serve_forever()


# ---------------------------------------------------------------------------------------------- set-up


def kubectl(*args: str, input: str | None = None) -> str:
    return str(devcluster.kubectl(*args, input=input).stdout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def progress(describe: Callable[[], str], every: float = PROGRESS_EVERY) -> Iterator[None]:
    """Print describe() every `every` seconds while the block runs, so a long run is never silent."""
    stop = threading.Event()
    t0 = time.monotonic()

    def loop() -> None:
        while not stop.wait(every):
            common.console.print(f"[dim]  +{time.monotonic() - t0:4.0f}s {describe()}[/dim]")

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def job_pod_gpus(template: dict[str, Any]) -> list[int]:
    """The GPUs of each pod of one job's RayCluster (head included), as the operator builds it."""
    from rlhf_api.spec import RLHFJob
    from rlhf_operator.manifests import build_raycluster

    spec = build_raycluster(RLHFJob.model_validate(template))["spec"]
    out: list[int] = []
    for group in [{**spec["headGroupSpec"], "replicas": 1}, *spec["workerGroupSpecs"]]:
        containers = group["template"]["spec"]["containers"]
        gpus = sum(int(c.get("resources", {}).get("requests", {}).get(GPU, 0)) for c in containers)
        out += [gpus] * max(int(group.get("replicas", 1)), int(group.get("maxReplicas", 0)))
    return out


def fits_any_order(n: int, shape: NodeShape, pod_gpus: list[int], jobs: int) -> bool:
    """Whether every pod of `jobs` jobs can be scheduled whatever the scheduler's choices: the nodes whose
    pod slots could all be taken left out, the rest hold every GPU even with each one's last
    (largest pod - 1) GPUs stranded."""
    usable = n - jobs * len(pod_gpus) // shape.pods
    return usable > 0 and jobs * sum(pod_gpus) <= usable * (shape.gpus - max(pod_gpus) + 1)


def plan_nodes(nodes: int | None, pod_gpus: list[int], jobs: int) -> tuple[int, NodeShape]:
    """(count, shape) of the bench nodes: `nodes` real 8-GPU ones, or (None) enough big ones, at least 2.
    Raises if the jobs cannot fit; warns if 8-GPU nodes fit them only with a lucky placement."""
    gpus, pods = jobs * sum(pod_gpus), jobs * len(pod_gpus)
    if nodes is None:
        shape = BIG_NODE
        nodes = max(2, math.ceil(gpus / shape.gpus), math.ceil(pods / shape.pods))
    else:
        shape = GPU_NODE
    if gpus > nodes * shape.gpus or pods > nodes * shape.pods or max(pod_gpus) > shape.gpus:
        raise RuntimeError(
            f"{jobs} jobs need {gpus} GPUs and {pods} pods ({pod_gpus} GPUs per pod): more than "
            f"{nodes} nodes of {shape.label} hold"
        )
    if shape is GPU_NODE and not fits_any_order(nodes, shape, pod_gpus, jobs):
        need = next(n for n in range(nodes, 100 * nodes) if fits_any_order(n, shape, pod_gpus, jobs))
        common.console.print(
            f"[yellow]{nodes} nodes fit the jobs only if the scheduler packs GPUs well; {need} always do[/yellow]"
        )
    return nodes, shape


def node_body(i: int, shape: NodeShape) -> dict[str, Any]:
    """A KWOK GPU node as the control plane's own (annotated for KWOK to manage it), of `shape`."""
    node = cast(dict[str, Any], devcluster.node_manifest(NODE_BASE + i))
    node["metadata"]["labels"][BENCH_LABEL[0]] = BENCH_LABEL[1]
    node["status"] = {"capacity": shape.capacity, "allocatable": shape.allocatable}
    return node


def add_nodes(core: Any, n: int, shape: NodeShape, threads: int = 16) -> None:
    """Create `n` KWOK nodes from a thread pool, then wait until each is Ready and without the not-ready
    taint (the TaintNodesByCondition admission plugin gives it to every new node; the node lifecycle
    controller, off here, is what would lift it)."""
    t0 = time.monotonic()
    state = {"created": 0, "schedulable": 0}

    with (
        ThreadPoolExecutor(threads) as pool,
        progress(lambda: f"nodes: {state['created']}/{n} created, {state['schedulable']}/{n} schedulable"),
    ):
        for _ in pool.map(lambda i: core.create_node(node_body(i, shape)), range(n)):
            state["created"] += 1
        untaint_when_ready(core, pool, n, state, timeout=120 + n / 2)
    common.console.print(
        f"[dim]{n} nodes ({shape.label}) Ready and schedulable in {time.monotonic() - t0:.0f}s[/dim]"
    )


def untaint_when_ready(
    core: Any, pool: ThreadPoolExecutor, n: int, state: dict[str, int], timeout: float
) -> None:
    """Remove the not-ready taint from each bench node once KWOK has marked it Ready, until all are done."""
    done: set[str] = set()
    deadline = time.monotonic() + timeout
    selector = f"{BENCH_LABEL[0]}={BENCH_LABEL[1]}"
    while len(done) < n:
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {len(done)} of {n} nodes Ready and schedulable in {timeout:.0f}s")
        ready = [nd for nd in core.list_node(label_selector=selector).items if node_ready(nd)]
        todo = [nd for nd in ready if nd.metadata.name not in done]
        list(pool.map(lambda nd: untaint(core, nd), todo))
        done.update(nd.metadata.name for nd in todo)
        state["schedulable"] = len(done)
        if len(done) < n:
            time.sleep(2.0)


def node_ready(node: Any) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in node.status.conditions or [])


def untaint(core: Any, node: Any) -> None:
    taints = node.spec.taints or []
    keep = [t for t in taints if t.key != NOT_READY_TAINT]
    if len(keep) < len(taints):
        value = core.api_client.sanitize_for_serialization(keep)
        core.patch_node(node.metadata.name, [{"op": "replace", "path": "/spec/taints", "value": value}])


def install_rbac() -> str:
    """The chart's ServiceAccount and cluster-wide RBAC, as `helm template` renders them; returns the
    ServiceAccount's user name."""
    helm = str(devcluster.binary_path("helm"))
    rendered = subprocess.run(
        [
            helm,
            "template",
            "rlhf-operator",
            str(ROOT / "charts" / "rlhf-operator"),
            f"--namespace={OPERATOR_NS}",
            f"--kube-version={devcluster.KUBERNETES_VERSION}",
            "--show-only=templates/serviceaccount.yaml",
            "--show-only=templates/rbac.yaml",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    kubectl("create", "namespace", OPERATOR_NS)
    kubectl("apply", "-n", OPERATOR_NS, "-f", "-", input=rendered)
    import yaml

    sa = next(d for d in yaml.safe_load_all(rendered) if d and d["kind"] == "ServiceAccount")
    return f"system:serviceaccount:{OPERATOR_NS}:{sa['metadata']['name']}"


def operator_kubeconfig(username: str) -> Path:
    """The admin kubeconfig's server with a fresh token of the operator's ServiceAccount instead."""
    sa = username.rsplit(":", 1)[1]
    token = kubectl("-n", OPERATOR_NS, "create", "token", sa, "--duration=6h").strip()
    admin = json.loads((STATE / "kubeconfig").read_text())
    path = WORK / "operator.kubeconfig"
    path.write_text(
        json.dumps(
            {
                **admin,
                "users": [{"name": sa, "user": {"token": token}}],
                "contexts": [{"name": sa, "context": {"cluster": admin["clusters"][0]["name"], "user": sa}}],
                "current-context": sa,
            }
        )
    )
    path.chmod(0o600)
    return path


def operator_env(
    args: argparse.Namespace, base: dict[str, str], kubeconfig: Path, port: int
) -> dict[str, str]:
    """The operator's environment: the development head override (every RayCluster's "head" is the
    stand-in), then --reconcile-interval, then each --operator-env KEY=VALUE."""
    env = {
        **base,
        "KUBECONFIG": str(kubeconfig),
        "RLHF_DEV_HEAD_HOST": "127.0.0.1",
        "RLHF_DEV_DASHBOARD_PORT": str(port),
    }
    if args.reconcile_interval is not None:
        env["RLHF_RECONCILE_INTERVAL"] = f"{args.reconcile_interval:g}"
    env.update(dict(args.operator_env))
    return env


def wait_http(url: str, timeout: float, proc: subprocess.Popen[bytes], what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited ({proc.returncode}); see {WORK}")
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2) as r:
            if r.status == 200:
                return
        time.sleep(0.3)
    raise RuntimeError(f"{what} not healthy at {url} in {timeout:.0f}s; see {WORK}")


@contextlib.contextmanager
def process(cmd: list[str], env: dict[str, str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


# ---------------------------------------------------------------------------------------------- measuring


def key_of(obj: dict[str, Any]) -> Key:
    return (obj["metadata"]["namespace"], obj["metadata"]["name"])


class Watcher:
    """Watches on every namespace (this process's clock): when each RayCluster first appeared, and each
    RLHFJob's phase and when it was first seen Running."""

    def __init__(self, kubeconfig: Path) -> None:
        from kubernetes import client, config

        self.api = client.CustomObjectsApi(config.new_client_from_config(config_file=str(kubeconfig)))  # type: ignore[no-untyped-call]
        self.clusters: dict[Key, float] = {}
        self.phases: dict[Key, str] = {}
        self.running: dict[Key, float] = {}
        self.cond = threading.Condition()
        self.stop = threading.Event()
        self.threads = [
            threading.Thread(target=self._run, args=("ray.io", "v1", "rayclusters"), daemon=True),
            threading.Thread(target=self._run, args=("rlhf.dev", "v1alpha1", "rlhfjobs"), daemon=True),
        ]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def _run(self, group: str, version: str, plural: str) -> None:
        """List once, then watch from there on (re-watching from the last version seen, relisting only
        when the stream breaks or the version is gone), so no periodic full list loads the API server."""
        import urllib3
        from kubernetes import watch
        from kubernetes.client.exceptions import ApiException

        rv = ""
        while not self.stop.is_set():
            try:
                if not rv:
                    listed = cast(dict[str, Any], self.api.list_cluster_custom_object(group, version, plural))
                    self._record(plural, listed["items"])
                    rv = str(listed["metadata"]["resourceVersion"])
                w = watch.Watch()  # type: ignore[no-untyped-call]
                for ev in w.stream(  # type: ignore[no-untyped-call]
                    self.api.list_cluster_custom_object,
                    group,
                    version,
                    plural,
                    resource_version=rv,
                    timeout_seconds=60,
                    allow_watch_bookmarks=True,
                ):
                    rv = str(w.resource_version or rv)
                    if ev["type"] != "BOOKMARK":
                        self._record(plural, [ev["object"]])
                    if self.stop.is_set():
                        w.stop()  # type: ignore[no-untyped-call]
            except (ApiException, OSError, ValueError, urllib3.exceptions.HTTPError):
                rv = ""  # 410 Gone or a dropped stream: list again
                time.sleep(0.2)

    def _record(self, plural: str, items: list[dict[str, Any]]) -> None:
        now = time.time()
        with self.cond:
            for obj in items:
                key = key_of(obj)
                if plural == "rayclusters":
                    self.clusters.setdefault(key, now)
                    continue
                phase = str((obj.get("status") or {}).get("phase") or "(none)")
                self.phases[key] = phase
                if phase == "Running":
                    self.running.setdefault(key, now)
            self.cond.notify_all()

    def wait_for(
        self, done: Callable[[], bool], timeout: float, what: str, check: Callable[[], None]
    ) -> None:
        """Until done() (called under the lock), calling check() each second (it raises to give up)."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while not done():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{what}: not done in {timeout:.0f}s")
                self.cond.wait(1.0)
                check()

    def seen(self, keys: list[Key]) -> Callable[[], bool]:
        return lambda: all(k in self.clusters for k in keys)

    def all_running(self, jobs: list[Key]) -> Callable[[], bool]:
        return lambda: all(self.phases.get(j) == "Running" for j in jobs)

    def summary(self, ns: str, n: int) -> str:
        """RayClusters seen, jobs Running, and the jobs' phases in a namespace (for progress lines)."""
        with self.cond:
            clusters = sum(1 for k in self.clusters if k[0] == ns)
            phases = Counter(p for k, p in self.phases.items() if k[0] == ns)
        return f"{clusters}/{n} RayClusters, {phases.get('Running', 0)}/{n} Running; phases {dict(phases)}"


class AuditTail:
    """One user's write entries from the API server's audit log, read while the server writes it. The log
    backend renames audit.log at --audit-log-maxsize (200 MB here) and keeps one old part
    (--audit-log-maxbackup=1): following the file as it grows loses nothing however often it rotates."""

    def __init__(self, path: Path, username: str) -> None:
        self.path, self.username = path, username
        self.needle = username.encode()
        self.writes: list[dict[str, Any]] = []
        self.entries = self.bytes = self.rotations = 0
        self._file: Any = None
        self._inode = 0
        self._partial = b""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Stop following and read what is left."""
        self._stop.set()
        self._thread.join()
        self.poll()
        if self._file is not None:
            self._file.close()

    def _loop(self) -> None:
        while not self._stop.wait(1.0):
            self.poll()

    def poll(self) -> None:
        """Read what was appended; after a rotation finish the renamed part, then go on with the new file."""
        if self._file is None:
            try:
                self._file = self.path.open("rb")
            except FileNotFoundError:
                return
            self._inode = os.fstat(self._file.fileno()).st_ino
        self._read()
        with contextlib.suppress(FileNotFoundError):
            if self.path.stat().st_ino != self._inode:
                self._read()  # the renamed part is complete now
                self._file.close()
                self._file, self._partial = None, b""
                self.rotations += 1
                self.poll()

    def _read(self) -> None:
        while chunk := self._file.read(16 << 20):
            self.bytes += len(chunk)
            lines = (self._partial + chunk).split(b"\n")
            self._partial = lines.pop()
            self.entries += len(lines)
            for line in lines:
                if self.needle in line:
                    self._keep(json.loads(line))

    def _keep(self, ev: dict[str, Any]) -> None:
        if ev.get("user", {}).get("username") == self.username and ev.get("verb") in WRITE_VERBS:
            ev["_t"] = datetime.fromisoformat(ev["stageTimestamp"]).timestamp()
            self.writes.append(ev)


def job_template(port: int) -> dict[str, Any]:
    """examples/rlhfjob-tiny.yaml with its trainer metrics served by the stand-in."""
    import yaml

    doc: dict[str, Any] = yaml.safe_load((ROOT / "examples" / "rlhfjob-tiny.yaml").read_text())
    doc["metadata"] = {"name": "tiny", "namespace": "default"}
    doc["spec"]["monitoring"].update(metricsPort=port, stallTimeoutSeconds=3600)
    return doc


def job_body(template: dict[str, Any], name: str, namespace: str) -> dict[str, Any]:
    return {**template, "metadata": {"name": name, "namespace": namespace}}


@dataclass
class Phase:
    """One group of jobs: when each was created, when its RayCluster appeared and when it was Running."""

    namespace: str
    created: dict[str, float] = field(default_factory=dict)
    latency: dict[str, float] = field(default_factory=dict)
    to_running: dict[str, float] = field(default_factory=dict)
    start: float = 0.0
    clusters_done: float = 0.0
    running_done: float = 0.0
    end: float = 0.0
    # CPU seconds of each process, and the wall time, at start, last RayCluster, all Running, end.
    cpu: list[dict[str, float]] = field(default_factory=list)
    marks: list[float] = field(default_factory=list)

    def checkpoint(self, pids: dict[str, int]) -> float:
        self.cpu.append(cpu_seconds(pids))
        self.marks.append(time.time())
        return self.marks[-1]

    def cpu_used(self, proc: str, i: int, j: int) -> float:
        """CPU seconds `proc` used between checkpoints i and j."""
        return self.cpu[j].get(proc, 0.0) - self.cpu[i].get(proc, 0.0)

    def cores(self, proc: str, i: int, j: int) -> float:
        """`proc`'s mean cores between checkpoints i and j."""
        return self.cpu_used(proc, i, j) / max(self.marks[j] - self.marks[i], 1e-9)

    def create_rate(self) -> float:
        """Jobs POSTed per second, first POST to last."""
        ts = sorted(self.created.values())
        return (len(ts) - 1) / (ts[-1] - ts[0]) if len(ts) > 1 and ts[-1] > ts[0] else float("nan")


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """user+system CPU seconds of each process so far (/proc/<pid>/stat); this process as `client`."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for name, pid in {**pids, "client": os.getpid()}.items():
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            out[name] = (int(fields[11]) + int(fields[12])) / tick
    return out


def rss_mib(pid: int, field: str = "VmHWM") -> float:
    """A process's peak resident memory so far (VmHWM in /proc/<pid>/status), or another field such as
    VmRSS (now), MiB; NaN if unreadable."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def percentile(xs: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    s = sorted(xs)
    if not s:
        return float("nan")
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def phases_of(custom: Any, namespace: str) -> Counter[str]:
    items = custom.list_namespaced_custom_object("rlhf.dev", "v1alpha1", namespace, "rlhfjobs")["items"]
    return Counter(str(i.get("status", {}).get("phase") or "(none)") for i in items)


def event_reasons(core: Any, namespace: str) -> Counter[str]:
    """The Events about RLHFJobs (all posted by the operator), by reason: what the `create events` are."""
    out: Counter[str] = Counter()
    for ev in core.list_namespaced_event(namespace).items:
        if ev.involved_object.kind == "RLHFJob":
            msg = ev.message if ev.reason == "Logging" else ""  # kopf's own log lines, posted as Events
            out[f"{ev.reason} {msg}".strip()[:60]] += ev.count or 1
    return out


def create_paced(names: list[str], create: Callable[[str], None], qps: float, threads: int) -> None:
    """POST on a fixed schedule, job i at i/qps seconds after the first (qps 0: as fast as possible), from
    `threads` client threads each taking the next job in turn."""
    t0 = time.monotonic()
    queue = iter(enumerate(names))
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                item = next(queue, None)
            if item is None:
                return
            i, name = item
            if qps > 0 and (delay := t0 + i / qps - time.monotonic()) > 0:
                time.sleep(delay)
            create(name)

    with ThreadPoolExecutor(threads) as pool:
        for f in [pool.submit(worker) for _ in range(threads)]:
            f.result()


def wait_timeout(jobs: int) -> float:
    """How long a phase may take to get every RayCluster, then every job Running: 600 s for 100 jobs,
    3,300 s for 1,000."""
    return 300 + 3 * jobs


@dataclass
class Bench:
    """What a phase needs: the watches, the API, the job template, the processes to account and check."""

    watch: Watcher
    custom: Any
    template: dict[str, Any]
    pids: dict[str, int]
    operator: subprocess.Popen[bytes]

    def check(self) -> None:
        """Give up at once if the operator died or a job failed (a long wait would only time out)."""
        if self.operator.poll() is not None:
            raise RuntimeError(
                f"the operator exited ({self.operator.returncode}); see {WORK / 'operator.log'}"
            )
        failed = [k for k, phase in self.watch.phases.items() if phase == "Failed"]
        if failed:
            raise RuntimeError(f"{len(failed)} job(s) Failed, e.g. {failed[0]}; see {WORK / 'operator.log'}")


def run_phase(b: Bench, ph: Phase, names: list[str], qps: float, threads: int, settle: float) -> None:
    """Create the jobs (threads 1: each after the previous one's RayCluster exists, plus 1 s; otherwise at
    `qps`), wait for their clusters and for every job to be Running, then let the operator run `settle`
    more seconds."""
    from rlhf_operator.manifests import raycluster_name

    ns, n = ph.namespace, len(names)
    keys = {name: (ns, raycluster_name(name)) for name in names}
    jobs = [(ns, name) for name in names]

    def create(name: str) -> None:
        body = job_body(b.template, name, ns)
        ph.created[name] = time.time()  # before the POST
        b.custom.create_namespaced_custom_object("rlhf.dev", "v1alpha1", ns, "rlhfjobs", body)

    ph.start = ph.checkpoint(b.pids)
    w, timeout = b.watch, wait_timeout(n)
    with progress(lambda: f"{ns}: {len(ph.created)}/{n} created, {w.summary(ns, n)}"):
        if threads == 1:
            for name in names:
                create(name)
                w.wait_for(w.seen([keys[name]]), 120, f"RayCluster of {name}", b.check)
                time.sleep(1.0)  # the operator goes idle again before the next one
        else:
            create_paced(names, create, qps, threads)
        w.wait_for(w.seen(list(keys.values())), timeout, f"{ns}: every RayCluster", b.check)
        ph.checkpoint(b.pids)
        w.wait_for(w.all_running(jobs), timeout, f"{ns}: every job Running", b.check)
        ph.running_done = ph.checkpoint(b.pids)
    ph.clusters_done = max((b.watch.clusters[k] for k in keys.values()), default=ph.start)
    ph.latency = {name: b.watch.clusters[keys[name]] - ph.created[name] for name in names}
    ph.to_running = {name: b.watch.running[(ns, name)] - ph.created[name] for name in names}
    common.console.print(f"[dim]{ns}: all {n} Running; {settle:.0f} s of steady state ...[/dim]")
    time.sleep(settle)
    b.check()
    ph.end = ph.checkpoint(b.pids)


def kind_of(ev: dict[str, Any]) -> str:
    ref = ev.get("objectRef", {})
    sub = f"/{ref['subresource']}" if ref.get("subresource") else ""
    return f"{ev['verb']} {ref.get('resource', '?')}{sub}"


def in_window(writes: list[dict[str, Any]], ns: str, t0: float, t1: float) -> list[dict[str, Any]]:
    return [e for e in writes if e.get("objectRef", {}).get("namespace") == ns and t0 <= e["_t"] <= t1]


# ---------------------------------------------------------------------------------------------- main


@dataclass
class Plan:
    """What the run is set to do, decided before the control plane starts."""

    nodes: int
    shape: NodeShape
    threads: int
    port: int  # the stand-in Ray dashboard and trainer /metrics
    health: int  # the operator's liveness endpoint
    template: dict[str, Any]
    pod_gpus: list[int]


@dataclass
class Run:
    """What the run measured."""

    solo: Phase
    burst: Phase
    writes: list[dict[str, Any]]
    final: dict[str, Counter[str]]
    events: dict[str, Counter[str]]
    rss: dict[str, float]
    audit: AuditTail
    idle: Phase


def env_pair(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=100, help="RLHFJobs created in the burst")
    p.add_argument(
        "--nodes", type=int, help="KWOK nodes shaped like a real 8-GPU machine (default: a few huge nodes)"
    )
    p.add_argument("--qps", type=float, default=100.0, help="burst creation rate, jobs/s (0: unpaced)")
    p.add_argument("--parallel", type=int, help="client threads creating the burst (default: qps, >= 8)")
    p.add_argument("--solo", type=int, default=5, help="RLHFJobs created one at a time first (idle operator)")
    p.add_argument(
        "--settle", type=float, default=30.0, help="seconds the operator runs on after all are Running"
    )
    p.add_argument(
        "--reconcile-interval",
        type=float,
        help="RLHF_RECONCILE_INTERVAL (seconds) for the operator (default: unset, the operator's own)",
    )
    p.add_argument(
        "--operator-env",
        type=env_pair,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="more operator environment, after --reconcile-interval (repeatable)",
    )
    p.add_argument("--operator-verbose", action="store_true", help="kopf debug log (its patches) in the log")
    p.add_argument(
        "--operator-memray",
        type=Path,
        metavar="FILE",
        help="run the operator under memray (pip install memray), write its capture to FILE and report the "
        "allocation sites live at the heap's peak (slows the operator)",
    )
    p.add_argument("--keep-cluster", action="store_true", help="leave the control plane up (for inspection)")
    p.add_argument("--serve-stand-in", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.jobs < 1 or args.solo < 0 or args.qps < 0 or (args.nodes is not None and args.nodes < 1):
        p.error("--jobs and --nodes must be at least 1, --solo and --qps at least 0")
    if args.operator_memray and importlib.util.find_spec("memray") is None:
        p.error("--operator-memray needs memray: .venv/bin/pip install memray")
    return args


def make_plan(args: argparse.Namespace) -> Plan:
    template = job_template(free_port())
    pod_gpus = job_pod_gpus(template)
    nodes, shape = plan_nodes(args.nodes, pod_gpus, args.jobs + args.solo)
    # Open loop: enough threads that each POST starts on schedule while up to 1 s of earlier ones are still
    # being served (the API server took 0.3-0.9 s per RLHFJob POST at 100/s on 2 cores).
    threads = args.parallel or max(8, math.ceil(args.qps))
    port = int(template["spec"]["monitoring"]["metricsPort"])
    return Plan(nodes, shape, threads, port, free_port(), template, pod_gpus)


def header(args: argparse.Namespace, plan: Plan) -> None:
    rate = f"{args.qps:g} jobs/s" if args.qps > 0 else "unpaced"
    interval = f"{args.reconcile_interval:g} s" if args.reconcile_interval is not None else "operator default"
    extra = " ".join(f"{k}={v}" for k, v in args.operator_env) or "none"
    common.console.print(
        f"operator_scale: {args.jobs} jobs at {rate} ({plan.threads} client threads) after {args.solo} one "
        f"at a time; {plan.nodes} KWOK nodes of {plan.shape.label} (a job's pods: {plan.pod_gpus} GPUs); "
        f"settle {args.settle:g} s; reconcile interval: {interval}; more operator env: {extra}; "
        f"KubeRay flags: {os.environ.get('RLHF_KUBERAY_ARGS', '')}"
    )


def main() -> None:
    args = parse_args()
    if args.serve_stand_in:
        serve_stand_in(args.serve_stand_in)
        return

    common.print_machine()
    try:
        plan = make_plan(args)
    except RuntimeError as e:
        common.fail(str(e))
    header(args, plan)
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    common.console.print(f"[dim]control plane in {STATE}; logs and audit extract in {WORK}[/dim]")
    try:
        if devcluster.read_state():
            devcluster.down(quiet=True)  # a leftover of an interrupted run: start clean
        devcluster.up()
        run = measure(args, plan)
    except (devcluster.ClusterError, RuntimeError, subprocess.CalledProcessError) as e:
        common.fail(f"{e}\n(operator log: {WORK / 'operator.log'})")
    finally:
        for part in (STATE / "logs").glob("audit*.log"):
            shutil.copy(part, WORK / part.name)
        if not args.keep_cluster:
            devcluster.down(quiet=True)
    report(args, plan, run)


def api_clients(threads: int) -> tuple[Any, Any]:
    """(CustomObjectsApi, CoreV1Api) as admin, with a connection per client thread."""
    from kubernetes import client, config

    api_client = config.new_client_from_config(config_file=str(STATE / "kubeconfig"))  # type: ignore[no-untyped-call]
    api_client.configuration.connection_pool_maxsize = max(16, threads) + 4
    api_client.rest_client = client.rest.RESTClientObject(api_client.configuration)
    return client.CustomObjectsApi(api_client), client.CoreV1Api(api_client)


def prepare(core: Any, plan: Plan) -> tuple[str, Path]:
    """The CRD, the nodes, the operator's RBAC and token, the namespaces; returns (user name, kubeconfig)."""
    crd = ROOT / "crds" / "rlhfjobs.rlhf.dev.yaml"
    kubectl("apply", "--server-side", "--force-conflicts", "-f", str(crd))
    add_nodes(core, plan.nodes, plan.shape)  # meanwhile the CRD's status gets its conditions
    kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd/rlhfjobs.rlhf.dev")
    username = install_rbac()
    kubeconfig = operator_kubeconfig(username)
    for ns in (SOLO_NS, BURST_NS):
        kubectl("create", "namespace", ns)
    return username, kubeconfig


def idle_baseline(pids: dict[str, int], seconds: float = 10.0) -> Phase:
    """The control plane's CPU with every node up but no operator or job yet: KWOK renews each node's
    Lease every 10 s, which the API server and etcd serve in every window below too."""
    common.console.print(f"[dim]{seconds:.0f} s idle (the control plane's CPU with no jobs) ...[/dim]")
    idle = Phase("idle")
    idle.checkpoint(pids)
    time.sleep(seconds)
    idle.checkpoint(pids)
    return idle


def operator_cmd(args: argparse.Namespace, plan: Plan) -> list[str]:
    cmd = ["operator", "--all-namespaces", "--metrics-port", "0"]
    cmd += ["--liveness", f"http://127.0.0.1:{plan.health}/healthz"]
    cmd += ["--verbose"] if args.operator_verbose else []
    if args.operator_memray:
        return heap.memray_command(sys.executable, "rlhf_cli.main", cmd, args.operator_memray)
    return [str(Path(sys.executable).parent / "rlhf"), *cmd]


def run_phases(args: argparse.Namespace, plan: Plan, b: Bench) -> tuple[Phase, Phase]:
    """The solo jobs one at a time, then the burst at --qps; returns (solo, burst)."""
    solo, burst = Phase(SOLO_NS), Phase(BURST_NS)
    common.console.print(f"[dim]{args.solo} jobs one at a time ...[/dim]")
    run_phase(b, solo, [f"solo-{i}" for i in range(args.solo)], 0, 1, args.settle)
    common.console.print(f"[dim]{args.jobs} jobs at {args.qps:g} jobs/s ...[/dim]")
    width = max(3, len(str(args.jobs - 1)))
    names = [f"job-{i:0{width}d}" for i in range(args.jobs)]
    run_phase(b, burst, names, args.qps, plan.threads, args.settle)
    b.check()
    return solo, burst


def measure(args: argparse.Namespace, plan: Plan) -> Run:
    custom, core = api_clients(plan.threads)
    username, kubeconfig = prepare(core, plan)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RLHF_", "KUBECONFIG"))}
    stand_in = [sys.executable, __file__, "--serve-stand-in", str(plan.port)]
    state = cast(dict[str, Any], devcluster.read_state() or {})
    pids = {str(k): int(v) for k, v in state["pids"].items()}
    idle = idle_baseline(pids)
    audit = AuditTail(STATE / "logs" / "audit.log", username)
    audit.start()
    try:
        with (
            process(stand_in, env, WORK / "stand-in.log") as si,
            process(
                operator_cmd(args, plan),
                operator_env(args, env, kubeconfig, plan.port),
                WORK / "operator.log",
            ) as op,
        ):
            wait_http(f"http://127.0.0.1:{plan.port}/metrics", 30, si, "the stand-in Ray dashboard")
            wait_http(f"http://127.0.0.1:{plan.health}/healthz", 60, op, "the operator")
            watch = Watcher(STATE / "kubeconfig")
            watch.start()
            pids.update({"rlhf operator": op.pid, "stand-in Ray": si.pid})
            solo, burst = run_phases(args, plan, Bench(watch, custom, plan.template, pids, op))
            rss = {p: rss_mib(pids[p]) for p in ("rlhf operator", "kube-apiserver")}
            rss["rlhf operator now"] = rss_mib(op.pid, "VmRSS")
            final = {ns: phases_of(custom, ns) for ns in (SOLO_NS, BURST_NS)}
            events = {ns: event_reasons(core, ns) for ns in (SOLO_NS, BURST_NS)}
            watch.stop.set()
    finally:
        time.sleep(1.0)  # the audit log is written asynchronously (batch backend off: within ms)
        audit.close()
    with (WORK / "operator-writes.jsonl").open("w") as f:
        for e in audit.writes:
            f.write(json.dumps(e) + "\n")
    refused = [e for e in audit.writes if e.get("responseStatus", {}).get("code") == 403]
    if refused:
        raise RuntimeError(
            f"the API server refused {len(refused)} operator writes, e.g. {kind_of(refused[0])}"
        )
    return Run(solo, burst, audit.writes, final, events, rss, audit, idle)


# ---------------------------------------------------------------------------------------------- report


def report(args: argparse.Namespace, plan: Plan, run: Run) -> None:
    solo, burst = run.solo, run.burst
    windows = {
        SOLO_NS: in_window(run.writes, SOLO_NS, solo.start, solo.end),
        BURST_NS: in_window(run.writes, BURST_NS, burst.start, burst.end),
    }
    latency_table(args, run)
    b_parts = writes_table(args, run, windows)
    events_table(run)
    cpu_table(burst)
    notes(args, run, windows)
    heap_peak = heap_table(args.operator_memray) if args.operator_memray else 0
    n_burst = len(burst.latency)
    s_lat, b_lat = list(solo.latency.values()), list(burst.latency.values())
    steady_s = burst.end - burst.running_done
    steady = sum(b_parts[2].values()) / n_burst / steady_s * 60
    common.result(
        {
            "p50_s": rounded(percentile(b_lat, 50), 3),
            "p99_s": rounded(percentile(b_lat, 99), 3),
            "writes_per_job": rounded(len(windows[BURST_NS]) / n_burst, 2),
            # the same without requests the API server refused (409 duplicates, kopf's 422 stale-finalizer
            # patch): what was written
            "applied_writes_per_job": rounded(
                sum(1 for e in windows[BURST_NS] if e.get("responseStatus", {}).get("code", 200) < 300)
                / n_burst,
                2,
            ),
            "writes_window_s": rounded(burst.end - burst.start, 1),
            "steady_writes_per_job_per_min": rounded(steady, 2),
            "solo_p50_s": rounded(percentile(s_lat, 50), 3),
            "solo_writes_per_job": rounded(len(windows[SOLO_NS]) / max(len(solo.latency), 1), 2),
            "jobs": n_burst,
            "nodes": plan.nodes,
            "node_gpus": plan.shape.gpus,
            "qps": args.qps,
            "qps_achieved": rounded(burst.create_rate(), 1),
            "last_cluster_s": rounded(burst.clusters_done - burst.start, 1),
            "all_running_s": rounded(burst.running_done - burst.start, 1),
            "running_p50_s": rounded(percentile(list(burst.to_running.values()), 50), 2),
            "running_p99_s": rounded(percentile(list(burst.to_running.values()), 99), 2),
            "operator_rss_mib": rounded(run.rss["rlhf operator"], 1),
            "operator_rss_end_mib": rounded(run.rss["rlhf operator now"], 1),
            "operator_cpu_steady_cores": rounded(burst.cores("rlhf operator", 2, 3), 3),
            "operator_cpu_burst_cores": rounded(burst.cores("rlhf operator", 0, 2), 3),
            "apiserver_cpu_steady_cores": rounded(burst.cores("kube-apiserver", 2, 3), 3),
            "apiserver_cpu_to_clusters_cores": rounded(burst.cores("kube-apiserver", 0, 1), 3),
            "apiserver_cpu_to_running_cores": rounded(burst.cores("kube-apiserver", 1, 2), 3),
            "apiserver_cpu_idle_cores": rounded(run.idle.cores("kube-apiserver", 0, 1), 3),
            "apiserver_rss_mib": rounded(run.rss["kube-apiserver"], 1),
            "settle_s": rounded(steady_s, 1),
            "solo": len(solo.latency),
            "reconcile_interval_s": args.reconcile_interval,
            "operator_env": dict(args.operator_env),
            **({"operator_heap_peak_mib": rounded(heap_peak / 2**20, 1)} if heap_peak else {}),
        }
    )


def heap_table(capture: Path, limit: int = 25) -> int:
    """The operator's heap at its peak by allocation site (memray); returns the peak in bytes."""
    peak, sites = heap.peak_sites(capture)
    rest = sites[limit:]
    common.table(
        f"Operator heap at its peak: {peak / 2**20:.1f} MiB, by allocation site (memray, {capture})",
        ["MiB", "blocks", "allocated in", "owners (innermost first, outside the standard library)"],
        [
            *[[s.size / 2**20, s.count, s.allocated_in, "\n".join(s.owners)] for s in sites[:limit]],
            [sum(s.size for s in rest) / 2**20, sum(s.count for s in rest), f"{len(rest)} more sites", ""],
        ],
    )
    return peak


def rounded(x: float, digits: int) -> float | None:
    """For the RESULT line: NaN (no samples, e.g. --solo 0) as null, which strict JSON parsers accept."""
    return None if math.isnan(x) else round(x, digits)


def latency_table(args: argparse.Namespace, run: Run) -> None:
    solo, burst = run.solo, run.burst
    s_lat, b_lat = list(solo.latency.values()), list(burst.latency.values())
    s_run, b_run = list(solo.to_running.values()), list(burst.to_running.values())
    rate = f"at {args.qps:g}/s" if args.qps > 0 else "unpaced"
    common.table(
        "Create -> RayCluster exists, and -> Running (seconds; the client's clock before the POST to the "
        "watch event)",
        ["", f"one at a time (n={len(s_lat)})", f"{len(b_lat)} {rate}"],
        [
            *[[f"RayCluster p{q}", percentile(s_lat, q), percentile(b_lat, q)] for q in (50, 90, 99)],
            ["RayCluster max", max(s_lat, default=math.nan), max(b_lat)],
            *[[f"Running p{q}", percentile(s_run, q), percentile(b_run, q)] for q in (50, 99)],
            ["jobs created per second (first POST to last)", solo.create_rate(), burst.create_rate()],
            [
                "last RayCluster after first create",
                solo.clusters_done - solo.start,
                burst.clusters_done - burst.start,
            ],
            [
                "every job Running after first create",
                solo.running_done - solo.start,
                burst.running_done - burst.start,
            ],
            ["final phases", dict(run.final[SOLO_NS]), dict(run.final[BURST_NS])],
        ],
    )


def split(ph: Phase, evs: list[dict[str, Any]]) -> list[Counter[str]]:
    """Writes by kind in three windows: create -> last RayCluster, -> all Running, the settle window."""
    parts: list[Counter[str]] = [Counter(), Counter(), Counter()]
    for e in evs:
        parts[0 if e["_t"] < ph.clusters_done else 1 if e["_t"] < ph.running_done else 2][kind_of(e)] += 1
    return parts


def writes_table(
    args: argparse.Namespace, run: Run, windows: dict[str, list[dict[str, Any]]]
) -> list[Counter[str]]:
    """Writes per job by resource and verb in each window; returns the burst's split."""
    n_solo, n_burst = max(len(run.solo.latency), 1), len(run.burst.latency)
    s_parts, b_parts = split(run.solo, windows[SOLO_NS]), split(run.burst, windows[BURST_NS])
    rows: list[list[Any]] = []
    for k in sorted(set().union(*s_parts, *b_parts)):
        rows.append(
            [k]
            + [s_parts[i][k] / n_solo for i in range(3)]
            + [sum(c[k] for c in s_parts) / n_solo]
            + [b_parts[i][k] / n_burst for i in range(3)]
            + [sum(c[k] for c in b_parts) / n_burst]
        )
    tot = ["total"] + [sum(s_parts[i].values()) / n_solo for i in range(3)] + [len(windows[SOLO_NS]) / n_solo]
    tot += [sum(b_parts[i].values()) / n_burst for i in range(3)] + [len(windows[BURST_NS]) / n_burst]
    rows.append(tot)
    s_win, b_win = run.solo.end - run.solo.start, run.burst.end - run.burst.start
    common.table(
        f"Operator API writes per job (audit log, ServiceAccount {OPERATOR_NS}/rlhf-operator). Windows: "
        f"to last RayCluster | to all Running | {args.settle:.0f} s settle; whole window "
        f"{s_win:.0f} s (solo), {b_win:.0f} s (burst)",
        [
            "verb resource",
            "solo: ->cluster",
            "->Running",
            "settle",
            "solo total",
            "burst: ->cluster",
            "->Running",
            "settle",
            "burst total",
        ],
        rows,
    )
    return b_parts


def events_table(run: Run) -> None:
    n_solo, n_burst = max(len(run.solo.latency), 1), len(run.burst.latency)
    reasons = sorted(set(run.events[SOLO_NS]) | set(run.events[BURST_NS]))
    common.table(
        "Events about RLHFJobs per job, by reason (the `create events` rows; whole run)",
        ["reason (kopf's `Logging` Events: the message)", "solo", "burst"],
        [[r, run.events[SOLO_NS][r] / n_solo, run.events[BURST_NS][r] / n_burst] for r in reasons],
    )


def cpu_table(burst: Phase) -> None:
    """Where the time goes: CPU seconds and mean cores per process in each window of the burst."""
    nproc = os.cpu_count() or 1
    procs = sorted(burst.cpu[0], key=lambda k: -burst.cpu_used(k, 0, 3))
    windows = [(0, 1), (1, 2), (2, 3)]
    rows: list[list[Any]] = []
    for k in procs:
        rows.append([k, *[x for i, j in windows for x in (burst.cpu_used(k, i, j), burst.cores(k, i, j))]])
    total = [sum(burst.cpu_used(k, i, j) for k in procs) for i, j in windows]
    walls = [burst.marks[j] - burst.marks[i] for i, j in windows]
    rows.append(["all of the above", *[x for t, w in zip(total, walls, strict=True) for x in (t, t / w)]])
    rows.append([f"machine capacity ({nproc} CPUs)", *[x for w in walls for x in (w * nproc, float(nproc))]])
    common.table(
        "Burst: CPU seconds and mean cores by process (where the time goes); windows of "
        + ", ".join(f"{w:.0f} s" for w in walls),
        ["process", "create -> last RayCluster", "cores", "-> all Running", "cores", "settle", "cores"],
        rows,
    )


def notes(args: argparse.Namespace, run: Run, windows: dict[str, list[dict[str, Any]]]) -> None:
    rate = run.burst.create_rate()
    if args.qps > 0 and rate < 0.9 * args.qps:
        common.console.print(
            f"[yellow]the burst was created at {rate:.0f} jobs/s, not {args.qps:g}: POSTs took longer than "
            "client threads / qps seconds; raise --parallel[/yellow]"
        )
    failed = Counter(
        f"{kind_of(e)} {e['responseStatus'].get('code')}"
        for evs in windows.values()
        for e in evs
        if e.get("responseStatus", {}).get("code", 200) >= 300
    )
    if failed:
        common.console.print(f"[yellow]non-2xx operator writes (counted above): {dict(failed)}[/yellow]")
    elsewhere = [e for e in run.writes if e.get("objectRef", {}).get("namespace") not in (SOLO_NS, BURST_NS)]
    common.console.print(
        f"[dim]operator writes outside the job namespaces (not per job): {dict(Counter(kind_of(e) for e in elsewhere))}[/dim]"
    )
    idle = ", ".join(f"{p} {run.idle.cores(p, 0, 1):.3f}" for p in ("kube-apiserver", "etcd", "kwok"))
    common.console.print(f"[dim]cores before the operator started (nodes up, no jobs): {idle}[/dim]")
    a = run.audit
    common.console.print(
        f"[dim]audit log read while written: {a.bytes / 2**20:.0f} MiB, {a.entries} entries (all users), "
        f"{a.rotations} rotation(s) followed; operator peak RSS {run.rss['rlhf operator']:.0f} MiB, "
        f"kube-apiserver {run.rss['kube-apiserver']:.0f} MiB[/dim]"
    )


if __name__ == "__main__":
    main()
