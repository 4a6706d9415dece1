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

from operator_scale.cli import main  # the package beside this file: a package wins over this file

if __name__ == "__main__":
    main()
