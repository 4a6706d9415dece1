"""100 RLHFJobs at once against the local control plane: create -> RayCluster latency, API writes per job.

The real operator (`rlhf operator`, kopf) runs as a local process holding only a token of the chart's
ServiceAccount, bound by the chart's own RBAC, so the API server's audit log names it: every
create/update/patch/delete it makes is counted there, per job and per resource. The control plane is
the project's own (etcd, kube-apiserver, controller-manager, scheduler, KWOK, KubeRay) in its own
directory and ports. RayCluster pods are KWOK pods (nothing runs in them), and a stand-in Ray dashboard
and trainer /metrics in a child process (the development head override, docs/development.md) let every
job reach its steady state, `Running`, without Ray. There is no peer operator to compare against: the
comparison is one job at a time on an idle operator vs 100 created together, in the same run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, cast

from lib import common

ROOT = common.ROOT
# Our own control plane, never the one the tests use (.cluster, default ports).
os.environ.setdefault("RLHF_CLUSTER_DIR", "/tmp/bench-cluster")
os.environ.setdefault("RLHF_CLUSTER_PORT_OFFSET", "200")
sys.path.insert(0, str(ROOT / "devcluster"))
import devcluster  # noqa: E402  (reads RLHF_CLUSTER_DIR at import)

WORK = Path("/tmp/rlhf-bench-opscale")
OPERATOR_NS = "rlhf-system"
SOLO_NS, BURST_NS = "bench-solo", "bench-burst"
WRITE_VERBS = ("create", "update", "patch", "delete", "deletecollection")
# Extra fake nodes big enough for every job's pods (the control plane's own two hold 8 GPUs each).
BENCH_NODES = 2
NODE_CAPACITY = {"cpu": "2000", "memory": "16Ti", "pods": "400", "nvidia.com/gpu": "400"}


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


def add_bench_nodes() -> None:
    """Two big KWOK nodes, so every job's RayCluster can be scheduled and become ready."""
    names = []
    for i in range(BENCH_NODES):
        node = devcluster.node_manifest(100 + i)
        node["status"] = {"capacity": NODE_CAPACITY, "allocatable": NODE_CAPACITY}
        kubectl("apply", "-f", "-", input=json.dumps(node))
        names.append(str(node["metadata"]["name"]))  # type: ignore[index]
    kubectl("wait", "--for=condition=Ready", "--timeout=60s", *[f"node/{n}" for n in names])
    for n in names:  # the not-ready taint every new node gets (devcluster._register_nodes says why)
        devcluster.kubectl("taint", "nodes", n, "node.kubernetes.io/not-ready:NoSchedule-", check=False)


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
    token = kubectl("-n", OPERATOR_NS, "create", "token", sa, "--duration=2h").strip()
    admin = json.loads((devcluster.STATE / "kubeconfig").read_text())
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


class ClusterWatch:
    """When each RayCluster first appeared, from a watch on every namespace (this process's clock)."""

    def __init__(self, kubeconfig: Path) -> None:
        from kubernetes import client, config

        self.api = client.CustomObjectsApi(config.new_client_from_config(config_file=str(kubeconfig)))  # type: ignore[no-untyped-call]
        self.seen: dict[tuple[str, str], float] = {}
        self.cond = threading.Condition()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        import urllib3
        from kubernetes import watch
        from kubernetes.client.exceptions import ApiException

        while not self.stop.is_set():
            try:
                listed = cast(
                    dict[str, Any], self.api.list_cluster_custom_object("ray.io", "v1", "rayclusters")
                )
                self._record(listed["items"])
                w = watch.Watch()  # type: ignore[no-untyped-call]
                for ev in w.stream(  # type: ignore[no-untyped-call]
                    self.api.list_cluster_custom_object,
                    "ray.io",
                    "v1",
                    "rayclusters",
                    resource_version=listed["metadata"]["resourceVersion"],
                    timeout_seconds=30,
                ):
                    self._record([ev["object"]])
                    if self.stop.is_set():
                        w.stop()  # type: ignore[no-untyped-call]
            except (ApiException, OSError, ValueError, urllib3.exceptions.HTTPError):
                time.sleep(0.2)  # 410 Gone or a dropped stream: list again

    def _record(self, items: list[dict[str, Any]]) -> None:
        now = time.time()
        with self.cond:
            for obj in items:
                key = (obj["metadata"]["namespace"], obj["metadata"]["name"])
                self.seen.setdefault(key, now)
            self.cond.notify_all()

    def wait_all(self, keys: list[tuple[str, str]], timeout: float) -> None:
        with self.cond:
            if not self.cond.wait_for(lambda: all(k in self.seen for k in keys), timeout):
                missing = [k for k in keys if k not in self.seen]
                raise RuntimeError(
                    f"{len(missing)} RayCluster(s) not created in {timeout:.0f}s: {missing[:5]}"
                )


def job_manifest(name: str, namespace: str, port: int) -> dict[str, Any]:
    """examples/rlhfjob-tiny.yaml with its trainer metrics served by the stand-in."""
    import yaml

    doc: dict[str, Any] = yaml.safe_load((ROOT / "examples" / "rlhfjob-tiny.yaml").read_text())
    doc["metadata"] = {"name": name, "namespace": namespace}
    doc["spec"]["monitoring"].update(metricsPort=port, stallTimeoutSeconds=3600)
    return doc


@dataclass
class Phase:
    """One group of jobs: when each was created, when its RayCluster appeared, the window it covers."""

    namespace: str
    created: dict[str, float] = field(default_factory=dict)
    latency: dict[str, float] = field(default_factory=dict)
    start: float = 0.0
    clusters_done: float = 0.0
    running_done: float = 0.0
    end: float = 0.0
    # CPU seconds of each process at start, last RayCluster, all Running, end (where the time goes).
    cpu: list[dict[str, float]] = field(default_factory=list)


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """user+system CPU seconds of each process so far (/proc/<pid>/stat); this process as `client`."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for name, pid in {**pids, "client": os.getpid()}.items():
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            out[name] = (int(fields[11]) + int(fields[12])) / tick
    return out


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


def wait_running(custom: Any, namespace: str, n: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if phases_of(custom, namespace).get("Running", 0) == n:
            return
        time.sleep(0.5)
    raise RuntimeError(
        f"not every job in {namespace} Running in {timeout:.0f}s: {dict(phases_of(custom, namespace))}"
    )


def run_phase(
    ph: Phase,
    names: list[str],
    watch: ClusterWatch,
    custom: Any,
    port: int,
    parallel: int,
    settle: float,
    pids: dict[str, int],
) -> None:
    """Create the jobs (`parallel` at a time; 1 = each after the previous one's RayCluster exists), wait for
    their clusters and for every job to be Running, then let the operator run `settle` more seconds."""
    from rlhf_operator.manifests import raycluster_name

    def create(name: str) -> None:
        body = job_manifest(name, ph.namespace, port)
        ph.created[name] = time.time()  # before the POST
        custom.create_namespaced_custom_object("rlhf.dev", "v1alpha1", ph.namespace, "rlhfjobs", body)

    ph.cpu.append(cpu_seconds(pids))
    ph.start = time.time()
    if parallel == 1:
        for name in names:
            create(name)
            watch.wait_all([(ph.namespace, raycluster_name(name))], 120)
            time.sleep(1.0)  # the operator goes idle again before the next one
    else:
        with ThreadPoolExecutor(parallel) as pool:
            list(pool.map(create, names))
    keys = [(ph.namespace, raycluster_name(n)) for n in names]
    watch.wait_all(keys, 600)
    ph.cpu.append(cpu_seconds(pids))
    ph.clusters_done = max(watch.seen[k] for k in keys)
    ph.latency = {n: watch.seen[(ph.namespace, raycluster_name(n))] - ph.created[n] for n in names}
    wait_running(custom, ph.namespace, len(names), 600)
    ph.running_done = time.time()
    ph.cpu.append(cpu_seconds(pids))
    time.sleep(settle)
    ph.end = time.time()
    ph.cpu.append(cpu_seconds(pids))


def audit_writes(username: str) -> list[dict[str, Any]]:
    """Every write the API server recorded for `username` (the audit policy keeps writes only)."""
    out = []
    audit = devcluster.STATE / "logs" / "audit.log"
    for path in sorted(audit.parent.glob("audit*.log")):  # a rotated part too, if any
        with path.open(errors="replace") as f:
            for line in f:
                if username not in line:
                    continue
                ev = json.loads(line)
                if ev.get("user", {}).get("username") == username and ev.get("verb") in WRITE_VERBS:
                    ev["_t"] = datetime.fromisoformat(ev["stageTimestamp"]).timestamp()
                    out.append(ev)
    return out


def kind_of(ev: dict[str, Any]) -> str:
    ref = ev.get("objectRef", {})
    sub = f"/{ref['subresource']}" if ref.get("subresource") else ""
    return f"{ev['verb']} {ref.get('resource', '?')}{sub}"


def in_window(writes: list[dict[str, Any]], ns: str, t0: float, t1: float) -> list[dict[str, Any]]:
    return [e for e in writes if e.get("objectRef", {}).get("namespace") == ns and t0 <= e["_t"] <= t1]


# ---------------------------------------------------------------------------------------------- main


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=100, help="RLHFJobs created together")
    p.add_argument("--solo", type=int, default=5, help="RLHFJobs created one at a time first (idle operator)")
    p.add_argument(
        "--settle", type=float, default=30.0, help="seconds the operator runs on after all are Running"
    )
    p.add_argument("--parallel", type=int, default=8, help="client threads creating the burst")
    p.add_argument("--operator-verbose", action="store_true", help="kopf debug log (its patches) in the log")
    p.add_argument("--keep-cluster", action="store_true", help="leave the control plane up (for inspection)")
    p.add_argument("--serve-stand-in", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve_stand_in:
        serve_stand_in(args.serve_stand_in)
        return

    common.print_machine()
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    common.console.print(f"[dim]control plane in {devcluster.STATE}; logs and audit extract in {WORK}[/dim]")
    try:
        if devcluster.read_state():
            devcluster.down(quiet=True)  # a leftover of an interrupted run: start clean
        devcluster.up()
        measured = measure(args)
    except (devcluster.ClusterError, RuntimeError, subprocess.CalledProcessError) as e:
        common.fail(f"{e}\n(operator log: {WORK / 'operator.log'})")
    finally:
        audit = devcluster.STATE / "logs" / "audit.log"
        if audit.exists():
            shutil.copy(audit, WORK / "audit.log")
        if not args.keep_cluster:
            devcluster.down(quiet=True)
    report(args, *measured)


def measure(
    args: argparse.Namespace,
) -> tuple[Phase, Phase, list[dict[str, Any]], dict[str, Counter[str]], dict[str, Counter[str]]]:
    from kubernetes import client, config

    admin = devcluster.STATE / "kubeconfig"
    add_bench_nodes()
    kubectl(
        "apply", "--server-side", "--force-conflicts", "-f", str(ROOT / "crds" / "rlhfjobs.rlhf.dev.yaml")
    )
    kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd/rlhfjobs.rlhf.dev")
    username = install_rbac()
    kubeconfig = operator_kubeconfig(username)
    for ns in (SOLO_NS, BURST_NS):
        kubectl("create", "namespace", ns)

    api_client = config.new_client_from_config(config_file=str(admin))  # type: ignore[no-untyped-call]
    api_client.configuration.connection_pool_maxsize = max(8, args.parallel * 2)
    api_client.rest_client = client.rest.RESTClientObject(api_client.configuration)
    custom = client.CustomObjectsApi(api_client)
    port, health = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RLHF_", "KUBECONFIG"))}
    op_env = {
        **env,
        "KUBECONFIG": str(kubeconfig),
        # The development head override: every RayCluster's "head" is the stand-in.
        "RLHF_DEV_HEAD_HOST": "127.0.0.1",
        "RLHF_DEV_DASHBOARD_PORT": str(port),
    }
    rlhf = str(Path(sys.executable).parent / "rlhf")
    op_cmd = [rlhf, "operator", "--all-namespaces", "--metrics-port", "0"]
    op_cmd += ["--liveness", f"http://127.0.0.1:{health}/healthz"]
    op_cmd += ["--verbose"] if args.operator_verbose else []
    stand_in = [sys.executable, __file__, "--serve-stand-in", str(port)]
    with (
        process(stand_in, env, WORK / "stand-in.log") as si,
        process(op_cmd, op_env, WORK / "operator.log") as op,
    ):
        wait_http(f"http://127.0.0.1:{port}/metrics", 30, si, "the stand-in Ray dashboard")
        wait_http(f"http://127.0.0.1:{health}/healthz", 60, op, "the operator")
        watch = ClusterWatch(admin)
        watch.start()
        pids = {str(k): int(v) for k, v in (devcluster.read_state() or {})["pids"].items()}
        pids.update({"rlhf operator": op.pid, "stand-in Ray": si.pid})
        solo, burst = Phase(SOLO_NS), Phase(BURST_NS)
        common.console.print(f"[dim]{args.solo} jobs one at a time ...[/dim]")
        names = [f"solo-{i}" for i in range(args.solo)]
        run_phase(solo, names, watch, custom, port, 1, args.settle, pids)
        common.console.print(f"[dim]{args.jobs} jobs at once ...[/dim]")
        names = [f"job-{i:03d}" for i in range(args.jobs)]
        run_phase(burst, names, watch, custom, port, args.parallel, args.settle, pids)
        final = {ns: phases_of(custom, ns) for ns in (SOLO_NS, BURST_NS)}
        core = client.CoreV1Api(api_client)
        events = {ns: event_reasons(core, ns) for ns in (SOLO_NS, BURST_NS)}
        watch.stop.set()
        if op.poll() is not None:
            raise RuntimeError(f"the operator exited ({op.returncode}); see {WORK / 'operator.log'}")
    time.sleep(1.0)  # the audit log is written asynchronously (batch backend off: within ms)
    writes = audit_writes(username)
    with (WORK / "operator-writes.jsonl").open("w") as f:
        for e in writes:
            f.write(json.dumps(e) + "\n")
    refused = [e for e in writes if e.get("responseStatus", {}).get("code") == 403]
    if refused:
        raise RuntimeError(
            f"the API server refused {len(refused)} operator writes, e.g. {kind_of(refused[0])}"
        )
    return solo, burst, writes, final, events


def report(
    args: argparse.Namespace,
    solo: Phase,
    burst: Phase,
    writes: list[dict[str, Any]],
    final: dict[str, Counter[str]],
    events: dict[str, Counter[str]],
) -> None:
    n_solo, n_burst = len(solo.latency), len(burst.latency)
    s_lat, b_lat = list(solo.latency.values()), list(burst.latency.values())
    windows = {
        "solo": (solo, in_window(writes, SOLO_NS, solo.start, solo.end)),
        "burst": (burst, in_window(writes, BURST_NS, burst.start, burst.end)),
    }
    common.table(
        "Create -> RayCluster exists (seconds; the client's clock before the POST to the watch event)",
        ["", f"one at a time (n={n_solo})", f"{n_burst} at once"],
        [
            ["p50", percentile(s_lat, 50), percentile(b_lat, 50)],
            ["p90", percentile(s_lat, 90), percentile(b_lat, 90)],
            ["p99", percentile(s_lat, 99), percentile(b_lat, 99)],
            ["max", max(s_lat), max(b_lat)],
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
            ["final phases", dict(final[SOLO_NS]), dict(final[BURST_NS])],
        ],
    )

    # Writes per job by resource and verb, in three windows: create -> last RayCluster, -> all Running,
    # and the settle window after that (steady state).
    def split(ph: Phase, evs: list[dict[str, Any]]) -> list[Counter[str]]:
        parts: list[Counter[str]] = [Counter(), Counter(), Counter()]
        for e in evs:
            parts[0 if e["_t"] < ph.clusters_done else 1 if e["_t"] < ph.running_done else 2][kind_of(e)] += 1
        return parts

    s_parts, b_parts = split(*windows["solo"]), split(*windows["burst"])
    kinds = sorted(set().union(*s_parts, *b_parts))
    rows: list[list[Any]] = []
    for k in kinds:
        rows.append(
            [k]
            + [s_parts[i][k] / n_solo for i in range(3)]
            + [sum(c[k] for c in s_parts) / n_solo]
            + [b_parts[i][k] / n_burst for i in range(3)]
            + [sum(c[k] for c in b_parts) / n_burst]
        )
    tot = (
        ["total"] + [sum(s_parts[i].values()) / n_solo for i in range(3)] + [len(windows["solo"][1]) / n_solo]
    )
    tot += [sum(b_parts[i].values()) / n_burst for i in range(3)] + [len(windows["burst"][1]) / n_burst]
    rows.append(tot)
    s_win, b_win = solo.end - solo.start, burst.end - burst.start
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
    reasons = sorted(set(events[SOLO_NS]) | set(events[BURST_NS]))
    common.table(
        "Events about RLHFJobs per job, by reason (the `create events` rows; whole run)",
        ["reason (kopf's `Logging` Events: the message)", "solo", "burst"],
        [[r, events[SOLO_NS][r] / n_solo, events[BURST_NS][r] / n_burst] for r in reasons],
    )
    # Where the time goes: CPU seconds per process in each window of the burst, against the machine's.
    cpu = burst.cpu
    walls = [
        burst.clusters_done - burst.start,
        burst.running_done - burst.clusters_done,
        burst.end - burst.running_done,
    ]
    nproc = os.cpu_count() or 1
    procs = sorted(cpu[0], key=lambda k: cpu[0][k] - cpu[-1][k])
    rows = [[k] + [cpu[i + 1][k] - cpu[i][k] for i in range(3)] for k in procs]
    rows.append(["all of the above"] + [sum(cpu[i + 1][k] - cpu[i][k] for k in procs) for i in range(3)])
    rows.append([f"machine capacity ({nproc} CPUs x wall)"] + [w * nproc for w in walls])
    common.table(
        "Burst: CPU seconds by process (where the time goes)",
        ["process", "create -> last RayCluster", "-> all Running", "settle"],
        rows,
    )
    failed = Counter(
        f"{kind_of(e)} {e['responseStatus'].get('code')}"
        for _, evs in windows.values()
        for e in evs
        if e.get("responseStatus", {}).get("code", 200) >= 300
    )
    if failed:
        common.console.print(f"[yellow]non-2xx operator writes (counted above): {dict(failed)}[/yellow]")
    elsewhere = [e for e in writes if e.get("objectRef", {}).get("namespace") not in (SOLO_NS, BURST_NS)]
    common.console.print(
        f"[dim]operator writes outside the job namespaces (not per job): {dict(Counter(kind_of(e) for e in elsewhere))}[/dim]"
    )
    steady = sum(b_parts[2].values()) / n_burst / args.settle * 60
    common.result(
        {
            "p50_s": round(percentile(b_lat, 50), 3),
            "p99_s": round(percentile(b_lat, 99), 3),
            "writes_per_job": round(len(windows["burst"][1]) / n_burst, 2),
            "writes_window_s": round(b_win, 1),
            "steady_writes_per_job_per_min": round(steady, 2),
            "solo_p50_s": round(percentile(s_lat, 50), 3),
            "solo_writes_per_job": round(len(windows["solo"][1]) / n_solo, 2),
            "jobs": n_burst,
        }
    )


if __name__ == "__main__":
    main()
