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

Run it as `python benchmarks/operator_scale.py` (docs/benchmarks.md). The modules, each importing only
those below it in this list:
    cli        the command line: parse, plan, run, report
    report     the tables and the RESULT line
    run        one run: plan, set-up, the operator under test, the solo and burst phases
    phases     one group of jobs: created, every RayCluster, every job Running, settled
    nodes      the KWOK GPU nodes: shapes, how many, created schedulable
    cluster    our own control plane (devcluster) and the child processes beside it
    watch      watches on RayClusters and RLHFJobs; the operator's writes in the audit log
    measures   progress lines, CPU and memory from /proc, percentiles
    stand_in   the stand-in Ray head and trainer /metrics (a child process)
"""
