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

The code is the package benchmarks/operator_scale/ (its docstring maps its modules); this file is the
entry point: `python benchmarks/operator_scale.py --help`.
"""

import os
import sys
from pathlib import Path

# Our own control plane, never the one the tests use (.cluster, default ports), and KWOK nodes only: no
# RayCluster pod tolerates the real node's taint, so it would only cost start-up time and CPU. Set here,
# in the entry point, before any module imports devcluster (which reads RLHF_CLUSTER_DIR at import); not
# in the package, whose import by a test must not point the test's own processes at this cluster.
os.environ.setdefault("RLHF_CLUSTER_DIR", "/tmp/bench-cluster")
os.environ.setdefault("RLHF_CLUSTER_PORT_OFFSET", "200")
# KubeRay reconciles one RayCluster at a time by default: with 1,000 new clusters that, not the RLHF
# operator, bounds the time until every job runs (about 0.3 clusters/s became ready here).
os.environ.setdefault("RLHF_KUBERAY_ARGS", "--reconcile-concurrency=8")
os.environ.setdefault("RLHF_REAL_NODE", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "devcluster"))

from operator_scale.cli import main  # the package beside this file wins over this file

if __name__ == "__main__":
    main()
