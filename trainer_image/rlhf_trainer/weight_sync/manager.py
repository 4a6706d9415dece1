"""The driver's side of weight sync: which backend, the channel around the ready engines, and each sync.

Owns `choose_backend` (the one place weightSync.backend "auto" is decided), the engine refresh between
steps (a membership change reopens the channel) and the bucketed sync itself. Must not move weights
through the driver: actor rank 0 sends each bucket straight to the engines.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import ray
from rlhf_api.spec import RLHFJobSpec

from rlhf_trainer.device import DeviceInfo
from rlhf_trainer.groups import RayGroup
from rlhf_trainer.metrics import PhaseTimer, TrainerExporter
from rlhf_trainer.rollout.pool import EnginePool, draining_nodes
from rlhf_trainer.weight_sync.channels import Rendezvous

GPU_ONLY = ("nccl", "cuda_ipc")


def choose_backend(
    requested: str,
    info: DeviceInfo,
    *,
    colocate_all: bool = False,
    sender_node: str | None = None,
    engine_nodes: Sequence[str] = (),
) -> str:
    """weightSync.backend (auto|nccl|gloo|cuda_ipc|shm) -> the transport to open.

    An explicit backend is kept (a GPU-only one on a CPU process is an error). auto: on GPU, cuda_ipc when
    every model shares the engines' devices (colocateAll), else nccl; on CPU, shm when every engine is on
    the sender's Ray node (one pod, one /dev/shm; benchmarks/weight_sync.py: 2-3x gloo's loopback TCP),
    else gloo.
    """
    if requested not in ("", "auto"):
        if requested in GPU_ONLY and info.is_cpu:
            raise ValueError(
                f"weightSync.backend={requested} needs CUDA; this job computes on the CPU stand-in "
                "(RLHF_GPU_STANDIN=cpu): use auto, gloo or shm"
            )
        return requested
    if not info.is_cpu:
        return "cuda_ipc" if colocate_all else "nccl"
    same_node = bool(engine_nodes) and all(n == sender_node for n in engine_nodes)
    return "shm" if same_node else "gloo"


def mismatched(rank0: dict[str, Any], engines: list[dict[str, Any]]) -> list[str]:
    """The engine workers whose bucket digests are not the trainer's ("engine i worker j")."""
    want = list(rank0["digests"])
    return [
        f"engine {i} worker {j}"
        for i, result in enumerate(engines)
        for j, got in enumerate(result["digests"])
        if list(got) != want
    ]


class WeightSyncManager:
    """Keeps the engines' weights equal to the actor's: refresh between steps, sync after training."""

    def __init__(
        self,
        spec: RLHFJobSpec,
        job: str,
        info: DeviceInfo,
        actor_group: RayGroup,
        pool: EnginePool,
        metrics: TrainerExporter,
        log: Callable[[str], None],
        *,
        resumed: bool,
    ) -> None:
        self.spec = spec
        self.job = job
        self.info = info
        self.actor_group = actor_group
        self.pool = pool
        self.metrics = metrics
        self.log = log
        self.resumed = resumed  # the engines loaded the actor's files, not the checkpoint's weights
        self.channel_version = -1  # the pool membership the open channel was built for (-1: none yet)
        # Called once the actor ranks are sending (fault injection: an engine lost mid-broadcast).
        self.while_sending: Callable[[], None] | None = None
        # Asked once per delta sync (fault injection): should engine 0 drop a delta frame?
        self.drop_delta: Callable[[], bool] | None = None
        # The engines' dtype (config.engine_options decided it): the sender casts to it. "auto" (vLLM
        # takes the model's): the parameters' own.
        dtype = str(pool.options.get("dtype", "auto"))
        self.wire_dtype = None if dtype == "auto" else dtype
        self.syncs_on_channel = 0  # delta: the first sync of a channel is verified
        self.stats: dict[str, float] = {}  # this step's sync figures (take_stats), delta sync only

    def refresh(self, timer: PhaseTimer) -> int:
        """Between steps: follow the cluster's rollout slots, let engines that finished starting join.

        Engines start in the background (training goes on with the ready ones); a membership change
        rebuilds the sync group and sends the current weights, since a new engine loaded the files.
        Returns the bytes sent.
        """
        sent = 0
        draining = self.retire_draining()
        self.pool.resize(self.pool.desired_from_cluster(self.spec.rollout.engines, draining))
        self.pool.poll()
        if not self.pool.ready():
            self.pool.wait_ready()
        if self.channel_version != self.pool.membership_version:
            with timer.phase("weight_sync"):
                if self.channel_version >= 0 or self.resumed:
                    sent = self.sync()
                else:  # first step, fresh start: the engines loaded the actor's own files
                    self.open_channel()
        self.metrics.set_engines(self.pool.counts())
        return sent

    def open_channel(self) -> None:
        """A new sync group: actor rank 0 (its store on a free port of its node) and every ready engine."""
        rank0 = self.actor_group.handles[0]
        addr, port = ray.get(rank0.address.remote())
        requested = self.spec.weight_sync.backend
        engine_nodes = [str(s.info.get("node_id", "")) for s in self.pool.ready()]
        auto_on_cpu = self.info.is_cpu and requested == "auto"
        sender = str(ray.get(rank0.node_id.remote())) if auto_on_cpu else None
        backend = choose_backend(
            requested,
            self.info,
            colocate_all=self.spec.trainer.colocate_all,
            sender_node=sender,
            engine_nodes=engine_nodes,
        )
        if auto_on_cpu:
            self.log(f"weight sync: auto -> {backend} for {len(engine_nodes)} engine(s)")
        rdzv = Rendezvous(
            backend=backend,
            master_addr=addr,
            master_port=port,
            world_size=self.pool.channel_world_size(),
            group_name=f"{self.job}-ws{self.pool.membership_version}",
        ).to_wire()
        refs = self.actor_group.call("open_weight_channel", rdzv) + self.pool.open_channel_refs(rdzv)
        ray.get(refs)
        self.channel_version = self.pool.membership_version
        self.syncs_on_channel = 0

    def retire_draining(self) -> set[str]:
        """Retire the engines whose pods are being deleted (their nodes drain); returns the draining nodes."""
        draining = draining_nodes()
        for slot in self.pool.retire_draining(draining):
            node = str(slot.info.get("node_id", ""))[:12]
            self.log(f"rollout engine {slot.index} retired: its node {node} is draining (its pod is going)")
        return draining

    def sync(self) -> int:
        """Bucketed gather on every actor rank; rank 0 sends each bucket once to all engines."""
        self.retire_draining()
        for slot in self.pool.prune_lost():
            self.log(f"rollout engine {slot.index} lost before the weight sync ({slot.info.get('error')})")
        if not self.pool.ready():
            raise RuntimeError("every rollout engine was lost before the weight sync")
        if self.channel_version != self.pool.membership_version:
            self.open_channel()
        plan = ray.get(
            self.actor_group.handles[0].weight_plan.remote(
                self.spec.weight_sync.bucket_size_mib << 20, self.wire_dtype
            )
        )
        delta = self.spec.weight_sync.delta
        if not delta.enabled:
            sent, _, _ = self._send(plan, None)
            return sent
        verify = self.syncs_on_channel % delta.verify_every == 0
        self.syncs_on_channel += 1
        drop = self.drop_delta is not None and self.drop_delta()
        sent, rank0, engines = self._send(plan, self._delta_wire(verify, full=False), drop)
        self._count(rank0, verify)
        if verify and (stale := mismatched(rank0, engines)):
            # an engine's copy is not the trainer's: send everything whole at once, and check again
            self.metrics.weight_sync_digest_mismatches.labels(self.job).inc(len(stale))
            self.stats["digest_mismatches"] = self.stats.get("digest_mismatches", 0) + len(stale)
            self.log(f"weight sync: engine copies differ from the trainer's ({', '.join(stale)}); full sync")
            more, rank0, engines = self._send(plan, self._delta_wire(True, full=True))
            sent += more
            self._count(rank0, True)
            self.stats["repairs"] = self.stats.get("repairs", 0) + 1
            if still := mismatched(rank0, engines):
                raise RuntimeError(
                    f"weight sync: a full sync left engine copies unlike the trainer's: {still}"
                )
        return sent

    def _delta_wire(self, verify: bool, *, full: bool) -> dict[str, object]:
        d = self.spec.weight_sync.delta
        return {"full_above": d.full_above, "recheck_every": d.recheck_every, "choose": d.choose,
                "verify": verify, "full": full}  # fmt: skip

    def _send(
        self, plan: list[dict[str, Any]], delta_wire: dict[str, object] | None, drop: bool = False
    ) -> tuple[int, dict[str, Any], list[dict[str, Any]]]:
        """One pass over the plan: every actor rank gathers, rank 0 sends, every ready engine receives.
        Returns the bytes the engines measured arriving, rank 0's figures and each engine's."""
        if delta_wire is None:
            sends = self.actor_group.call("send_weights")
            recvs = self.pool.receive_refs(plan)
        else:
            sends = self.actor_group.call("send_weights", delta_wire)
            engine_wires: list[dict[str, Any] | None] = [
                {"verify": delta_wire["verify"], "drop": drop and i == 0}
                for i in range(len(self.pool.ready()))
            ]
            recvs = self.pool.receive_refs(plan, engine_wires)
        if self.while_sending is not None:
            self.while_sending()
        rank0 = ray.get(sends)[0]
        engines = ray.get(recvs)
        # The bytes each engine measured arriving, summed: a bucket lost or cut short shows here.
        sent = sum(int(r["bytes"]) for r in engines)
        self.metrics.weight_sync_bytes.labels(self.job).inc(sent)
        return sent, rank0, engines

    def _count(self, rank0: dict[str, Any], verified: bool) -> None:
        """This step's delta figures: buckets by encoding, elements compared and changed, bytes."""
        for encoding, n in rank0["encodings"].items():
            self.stats[f"buckets_{encoding}"] = self.stats.get(f"buckets_{encoding}", 0) + n
            if n:
                self.metrics.weight_sync_buckets.labels(self.job, encoding).inc(n)
        for key in ("changed", "compared"):
            self.stats[key] = self.stats.get(key, 0) + float(rank0[key])
        self.stats["sent_bytes"] = self.stats.get("sent_bytes", 0) + float(rank0["bytes"])
        self.stats["full_bytes"] = self.stats.get("full_bytes", 0) + float(rank0["plan_bytes"])
        self.stats["verified"] = self.stats.get("verified", 0) + int(verified)

    def take_stats(self) -> dict[str, float]:
        """This step's figures (empty without weightSync.delta), reset for the next step."""
        out, self.stats = self.stats, {}
        return out

    def engines_sleep(self, asleep: bool) -> None:
        """Put the engines to sleep / wake them (only with rollout.enableSleep; a no-op on CPU)."""
        if self.spec.rollout.enable_sleep:
            ray.get([getattr(s.handle, "sleep" if asleep else "wake_up").remote() for s in self.pool.ready()])

    def close(self) -> None:
        """Close the channel before the groups go: the shm backend's buffer file is removed by its owner."""
        if self.channel_version >= 0:
            with contextlib.suppress(Exception):
                ray.get(self.actor_group.call("open_weight_channel", None), timeout=30)
