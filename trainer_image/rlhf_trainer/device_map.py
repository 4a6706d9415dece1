"""`rlhf plan FILE`: the job's device map without a cluster, placed by the trainer's own placement code.

Starts a private local Ray with one node per pod of the job (its GPUs as logical GPUs, its custom
resource as the operator renders it), places a light probe actor per process with the same functions the
driver uses (`placement.trainer_pools`, `options_for`, `engine_placer`), reads back each probe's node and
GPU ids, and checks them with `device_plan.problems`. Owns the probe and the output; must not decide any
placement itself.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import yaml
from rlhf_api.constants import ROLLOUT_RESOURCE, TRAINER_RESOURCE
from rlhf_api.pod_shape import rollout_pods, trainer_pods
from rlhf_api.spec import RLHFJobSpec

from rlhf_trainer import device_plan, groups
from rlhf_trainer.config import InputError, parse_spec
from rlhf_trainer.device import DeviceInfo
from rlhf_trainer.device_plan import Observed
from rlhf_trainer.plan_probe import probe

CPU_STANDIN = DeviceInfo("cpu", "gloo")  # the probes compute nothing: placement is all that is shown


def pods_of(spec: RLHFJobSpec) -> list[tuple[str, str, int]]:
    """(pod name, pod role, GPUs) of every pod the operator renders for the job."""
    n_trainer, trainer_gpus = trainer_pods(spec)
    n_rollout, rollout_gpus = rollout_pods(spec)
    return [(f"trainer-{i}", "trainer", trainer_gpus) for i in range(n_trainer)] + [
        (f"rollout-{i}", "rollout", rollout_gpus) for i in range(n_rollout)
    ]


def map_devices(spec: RLHFJobSpec) -> dict[str, Any]:
    """Place the plan on a local Ray shaped like the job's pods; the JSON result of `rlhf plan`."""
    import ray
    from ray.cluster_utils import Cluster
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from rlhf_trainer import placement

    t0 = time.perf_counter()
    plan = device_plan.plan(spec)
    pods = pods_of(spec)
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 0,
            "num_gpus": 0,
            "include_dashboard": False,
            "object_store_memory": 80 << 20,
        },
    )
    node_pod: dict[str, str] = {}
    try:
        for name, role, gpus in pods:
            custom = TRAINER_RESOURCE if role == "trainer" else ROLLOUT_RESOURCE
            units = gpus if role == "trainer" else spec.rollout.engines_per_worker
            node = cluster.add_node(
                wait=False,  # the raylets start side by side; wait_for_nodes below waits for all
                num_cpus=1,
                num_gpus=gpus,
                resources={custom: units},
                object_store_memory=80 << 20,
            )
            node_pod[node.node_id] = name
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        started = time.perf_counter()
        cpus = 0.01
        # A GPU task's worker exits after one call by default (max_calls=1): keep it, so one worker per
        # node serves every probe there, one after another, instead of a process start per probe.
        remote_probe: Any = ray.remote(max_calls=10_000)(probe)
        # One worker per pod, started side by side (about 3 s each here); the probes then reuse it.
        ray.get(
            [
                remote_probe.options(
                    num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)
                ).remote()
                for node_id in node_pod
            ],
            timeout=120,
        )
        pgs = placement.trainer_pools(plan, cpus)
        engine_place = placement.engine_placer(spec, plan, pgs, cpus, CPU_STANDIN)
        refs: dict[str, list[Any]] = {}
        for p in plan.processes:
            if p.roles == ("engine",):
                options, own = engine_place(p.rank)
                pg = own if own is not None else pgs[p.pool]
            else:
                pg = pgs[p.pool]
                options = placement.options_for(p, pg, cpus, CPU_STANDIN)
            # One at a time, so the pod's worker serves them all; then a TP engine's workers, likewise.
            parts = [ray.get(remote_probe.options(**options).remote(), timeout=120)]
            for bundle, share in zip(p.bundles[1:], p.shares[1:], strict=True):
                extra = groups.in_bundle(pg, bundle, groups.Resources(cpus, share, {}))
                parts.append(ray.get(remote_probe.options(**extra).remote(), timeout=120))
            refs[p.name] = parts
        observed: list[Observed] = []
        for name, got in refs.items():
            pods_seen = {node_pod.get(w["node_id"], w["node_id"]) for w in got}
            gpu_ids = tuple(int(g) for w in got for g in w["gpus"])
            observed.append(Observed(name, ",".join(sorted(pods_seen)), gpu_ids))
        print(
            f"rlhf plan: {len(pods)} pod(s) as Ray nodes up in {started - t0:.1f}s, "
            f"{len(refs)} process(es) placed in {time.perf_counter() - started:.1f}s",
            file=sys.stderr,
        )
    finally:
        ray.shutdown()
        # A throwaway cluster: SIGKILL its nodes, the head last, rather than stop each one gracefully
        # in turn (seconds per node on 2 cores); then Ray's own resets of this process's state.
        for node in [*cluster.worker_nodes, cluster.head_node]:
            if node is not None:
                cluster.remove_node(node, allow_graceful=False)  # type: ignore[no-untyped-call]
        cluster.shutdown()  # type: ignore[no-untyped-call]
    pod_gpus = {name: gpus for name, _, gpus in pods}
    found = device_plan.problems(plan, observed, pod_gpus)
    used = [(o.pod, g) for o in observed for g in o.gpus]
    return {
        "idle": device_plan.idle_gpus(used, pod_gpus),
        "ok": not found,
        "devices": device_plan.device_rows(plan, observed),
        "problems": found,
        "table": device_plan.table(plan, observed),
        "pods": [{"pod": name, "role": role, "gpus": gpus} for name, role, gpus in pods],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="rlhf plan",
        description="Print the device map of an RLHFJob (which GPU of which pod each rank, reward model and "
        "engine gets) by placing it on a local Ray shaped like the job's pods. Exit 1 when it breaks an "
        "invariant (whole GPUs per rank, sharing only where the spec colocates, no GPU idle).",
    )
    p.add_argument("file", help="an RLHFJob manifest (YAML)")
    p.add_argument("--output", choices=["table", "json"], default="table")
    args = p.parse_args(argv)
    try:
        manifest = yaml.safe_load(Path(args.file).read_text())
        spec = parse_spec(manifest)
    except (OSError, yaml.YAMLError, InputError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a private, loopback-only Ray that lives seconds
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_prestart_worker_first_driver", "0")  # no idle workers per node
    t0 = time.perf_counter()
    result = map_devices(spec)
    seconds = time.perf_counter() - t0
    if args.output == "json":
        print(json.dumps({k: result[k] for k in ("ok", "devices", "problems")}))
    else:
        shape = ", ".join(f"{x['pod']} ({x['gpus']} GPU)" for x in result["pods"])
        print(f"pods: {shape}")
        print(result["table"])
        for pod, gpus in result["idle"].items():
            print(f"note: {pod}: GPU(s) {gpus} unused (every trainer pod has the largest gpusPerNode)")
        for line in result["problems"]:
            print(f"problem: {line}")
        print(f"{'ok' if result['ok'] else 'BROKEN'}: placed in {seconds:.1f}s")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
