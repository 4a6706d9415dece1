"""`python benchmarks/operator_scale.py --help`: RLHFJobs at a steady rate on realistic KWOK GPU nodes.

The code, and what it measures, is the package benchmarks/operator_scale/ (its docstring); this file is
the entry point, which sets the benchmark's own cluster environment before the package imports devcluster.
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
