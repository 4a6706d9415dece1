"""Stack snapshots of a job's processes, for a step that hangs: which process is stuck, and where.

Every process of a job (driver, model ranks, rollout engines, reward scorer) arms a signal-driven
dump of its Python stacks at start (`dump.arm`); a snapshot signals them all, node by node, reads the
dumps with a time limit per process (`collect`), and reduces them to a verdict a person reads
(`summary`). `nccl` reads which transport NCCL chose, for a fabric that silently fell back to sockets.
"""
