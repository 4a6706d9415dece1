"""`rlhf diagnose JOB`: print the stack snapshot of a job's latest stall, from the ConfigMap
`<job>-stacks` the operator wrote (it outlives the pods and the restart). With the user's own
kubeconfig; reading a ConfigMap is all it needs.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, cast

from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException
from rlhf_api.spec import GROUP, PLURAL, VERSION

from rlhf_operator.diagnosis import config_map_name

FRAMES = 12  # innermost frames shown per process with --stacks


def render(summary: str, dump: dict[str, Any], frames: int = FRAMES) -> str:
    """The verdict, then each process: who, where, and its work thread's innermost frames."""
    out = [summary.rstrip(), ""]
    for p in dump.get("processes") or []:
        head = f"{p.get('who')} (pid {p.get('pid')}, pod {p.get('pod')})"
        if not p.get("answered"):
            out.append(f"{head}: did not answer (state {p.get('state', 'unknown')})")
            continue
        out.append(f"{head}: {p.get('where', '')}")
        threads = p.get("threads") or []
        work = next((t for t in threads if t.get("ident") == p.get("work_thread")), None)
        for f in (work or {}).get("frames", [])[:frames]:
            out.append(f"    {f['file']}:{f['line']} in {f['func']}")
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rlhf diagnose", description=__doc__)
    p.add_argument("job", help="the RLHFJob's name")
    p.add_argument("-n", "--namespace", default=None, help="its namespace (default: the context's)")
    p.add_argument("--stacks", action="store_true", help="also each process's innermost frames")
    p.add_argument("--json", action="store_true", help="the whole dump as JSON")
    p.add_argument("--kubeconfig", default=None)
    args = p.parse_args(argv)
    try:
        k8s_config.load_kube_config(config_file=args.kubeconfig)  # type: ignore[no-untyped-call]
        current = k8s_config.list_kube_config_contexts(args.kubeconfig)[1]  # type: ignore[no-untyped-call]
        namespace = args.namespace or current["context"].get("namespace", "default")
    except k8s_config.ConfigException:
        k8s_config.load_incluster_config()  # type: ignore[no-untyped-call]
        namespace = args.namespace or "default"
    api = k8s.ApiClient()
    name = config_map_name(args.job)
    try:
        cm = k8s.CoreV1Api(api).read_namespaced_config_map(name, namespace)
    except ApiException as e:
        if e.status != 404:
            print(
                f"rlhf diagnose: reading ConfigMap {namespace}/{name}: HTTP {e.status} {e.reason}",
                file=sys.stderr,
            )
            return 1
        print(
            f"rlhf diagnose: no stack snapshot for {namespace}/{args.job}: {_why_none(api, namespace, args.job)}",
            file=sys.stderr,
        )
        return 1
    data = cm.data or {}
    if args.json:
        print(data.get("stacks.json", "{}"))
        return 0
    dump = json.loads(data.get("stacks.json") or "{}") if args.stacks else {}
    sys.stdout.write(
        render(data.get("summary.txt", ""), dump) if args.stacks else data.get("summary.txt", "")
    )
    return 0


def _why_none(api: k8s.ApiClient, namespace: str, job: str) -> str:
    try:
        obj = cast(
            dict[str, Any],
            k8s.CustomObjectsApi(api).get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, job),
        )
    except ApiException as e:
        return f"the job cannot be read (HTTP {e.status} {e.reason})"
    diag = (obj.get("status") or {}).get("diagnosis")
    if not diag:
        return "it has not stalled (or its stall took no snapshot: monitoring.stackSnapshotTimeoutSeconds 0)"
    return f"status.diagnosis is {diag.get('state')}: {diag.get('summary') or 'no verdict yet'}"
