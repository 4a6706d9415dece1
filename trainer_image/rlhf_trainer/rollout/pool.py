"""The elastic pool of rollout engines: start, stop, count by state, and the weight-sync group around them.

Owns engine lifecycle between steps (the desired count comes from the cluster's rollout slots or the
spec) and opening the weight-sync channel on each ready engine. Must not hold rollout data: it hands out
actor handles. Must not import weight_sync: the rendezvous record is weight_sync.manager's.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, remove_placement_group
from rlhf_api.constants import ROLLOUT_RESOURCE

from rlhf_trainer.rollout.engine import RolloutEngine


def draining_nodes() -> set[str]:
    """Hex ids of the nodes Ray is draining. Best effort: when the GCS does not answer, none (the next
    call asks again, and an engine that goes undrained is handled as lost)."""
    try:
        from ray._private.state import state

        return set(state.get_draining_nodes())
    except Exception:
        return set()


# Engine index -> (its Ray .options: bundle and GPU share, the placement group it owns or None when it
# lives in another's, as under colocateAll). placement.py builds it from the device plan.
EnginePlacer = Callable[[int], tuple[dict[str, Any], PlacementGroup | None]]


@dataclass
class EngineSlot:
    index: int
    handle: Any
    state: str = "starting"  # starting | ready | failed | stopping
    ready_ref: Any = None
    info: dict[str, Any] = field(default_factory=dict)
    pg: PlacementGroup | None = None  # its own placement group (its GPUs), removed with it


class EnginePool:
    def __init__(self, options: dict[str, Any], placer: EnginePlacer, tensor_parallel: int) -> None:
        self.options = options
        self.placer = placer
        self.tp = tensor_parallel
        self.slots: list[EngineSlot] = []
        self._next_index = 0
        self.membership_version = 0

    # ---- size ---------------------------------------------------------------------------------
    def desired_from_cluster(self, fallback: int, draining: Collection[str] = ()) -> int:
        """Engines the cluster can hold now: total rollout slots of alive nodes that are not draining, else
        the spec's count."""
        slots = 0.0
        for node in ray.nodes():  # type: ignore[no-untyped-call]
            if node.get("Alive") and node.get("NodeID") not in draining:
                slots += float(node.get("Resources", {}).get(ROLLOUT_RESOURCE, 0.0))
        return int(slots) if slots > 0 else fallback

    def retire_draining(self, draining: Collection[str]) -> list[EngineSlot]:
        """Stop the engines on nodes Ray is draining (a rollout pod being deleted: rlhf_trainer.drain), while
        they still answer: retired between phases, never lost in the middle of a weight sync."""
        retired = [s for s in self.live() if s.info.get("node_id") in draining]
        for slot in retired:
            if slot.state == "ready":
                self.membership_version += 1
            slot.state = "stopping"
            with contextlib.suppress(Exception):  # going anyway with its node
                self._kill(slot)
            self.slots.remove(slot)
        return retired

    def resize(self, n: int) -> None:
        """Start or stop engines to reach n live ones; never blocks (new engines join when ready).

        Stopping takes the newest engines first; stopping a ready engine changes the membership.
        """
        while len(self.live()) > n:
            slot = self.live()[-1]
            if slot.state == "ready":
                self.membership_version += 1
            slot.state = "stopping"
            self._kill(slot)
            self.slots.remove(slot)
        for _ in range(n - len(self.live())):
            self._start_one()

    def _start_one(self) -> None:
        idx = self._next_index
        self._next_index += 1
        remote_cls = ray.remote(RolloutEngine)
        placed, pg = self.placer(idx)
        handle = remote_cls.options(  # type: ignore[attr-defined]
            **placed,
            max_concurrency=1,  # one LLM per actor: calls run one at a time
        ).remote(idx, self.options)
        slot = EngineSlot(index=idx, handle=handle, pg=pg)
        slot.ready_ref = handle.ready.remote()  # type: ignore[attr-defined]
        self.slots.append(slot)

    def poll(self, timeout: float = 0.0) -> bool:
        """Move started engines to ready (or failed); True if the ready set changed.

        timeout=0 only looks; a positive timeout waits up to that long for every starting engine.
        """
        starting = [s for s in self.slots if s.state == "starting"]
        if not starting:
            return False
        done, _ = ray.wait([s.ready_ref for s in starting], num_returns=len(starting), timeout=timeout)
        finished = set(done)
        changed = False
        for slot in starting:
            if slot.ready_ref not in finished:
                continue
            try:
                slot.info = ray.get(slot.ready_ref)
                slot.state = "ready"
                changed = True
            except Exception as e:  # the engine died while starting: counted, never silently used
                slot.state = "failed"
                slot.info = {"error": f"{type(e).__name__}: {e}"}
        if changed:
            self.membership_version += 1
        return changed

    def wait_ready(self, timeout: float = 900.0) -> None:
        """Block until every starting engine is ready or failed; error if none is ready."""
        self.poll(timeout)
        failed = [s for s in self.slots if s.state == "failed"]
        if not self.ready():
            reason = failed[0].info.get("error") if failed else f"still starting after {timeout:.0f}s"
            raise RuntimeError(f"no rollout engine is ready: {reason}")

    def mark_lost(self, slot: EngineSlot, error: BaseException) -> None:
        """An engine died (its process, pod or node is gone): never used again, counted as failed.

        The membership changes, so the next weight sync rebuilds its group without it.
        """
        if slot.state == "failed":
            return
        slot.state = "failed"
        slot.info = {"error": f"{type(error).__name__}: {error}"}
        self.membership_version += 1
        with contextlib.suppress(Exception):  # already dead; make sure Ray never restarts it
            self._kill(slot)

    def _kill(self, slot: EngineSlot) -> None:
        """Stop an engine and give back its GPUs (its placement group, if it owns one)."""
        try:
            ray.kill(slot.handle, no_restart=True)
        finally:
            if slot.pg is not None:
                remove_placement_group(slot.pg)
                slot.pg = None

    def prune_lost(self, timeout: float = 30.0) -> list[EngineSlot]:
        """Ping the ready engines; those that error (or do not answer in `timeout`) are marked lost.

        Run before a weight sync: a dead peer in the sync group would fail or hang the broadcast.
        """
        ready = self.ready()
        if not ready:
            return []
        lost: list[EngineSlot] = []
        deadline = time.monotonic() + timeout
        for slot in ready:  # one at a time: an unreachable actor can make ray.wait/ray.get raise at once
            try:
                ray.get(slot.handle.ready.remote(), timeout=max(0.1, deadline - time.monotonic()))
            except Exception as e:  # died, unreachable, or silent past the deadline
                self.mark_lost(slot, e)
                lost.append(slot)
        return lost

    # ---- views --------------------------------------------------------------------------------
    def live(self) -> list[EngineSlot]:
        return [s for s in self.slots if s.state in ("starting", "ready")]

    def ready(self) -> list[EngineSlot]:
        return [s for s in self.slots if s.state == "ready"]

    def counts(self) -> dict[str, int]:
        out = {"starting": 0, "ready": 0, "failed": 0, "stopping": 0}
        for s in self.slots:
            out[s.state] = out.get(s.state, 0) + 1
        return out

    # ---- weight-sync group ----------------------------------------------------------------------
    def channel_world_size(self) -> int:
        """Ranks in the weight-sync group: the trainer's rank 0 plus every ready engine's TP ranks."""
        return 1 + len(self.ready()) * self.tp

    def open_channel_refs(self, rdzv_wire: dict[str, Any]) -> list[Any]:
        return [
            s.handle.open_weight_channel.remote(rdzv_wire, 1 + i * self.tp)
            for i, s in enumerate(self.ready())
        ]

    def receive_refs(
        self, plan_wire: list[dict[str, Any]], delta_wires: list[dict[str, Any] | None] | None = None
    ) -> list[Any]:
        """One receive per ready engine; `delta_wires` (weightSync.delta) in the same order."""
        ready = self.ready()
        wires = delta_wires if delta_wires is not None else [None] * len(ready)
        return [s.handle.receive_weights.remote(plan_wire, w) for s, w in zip(ready, wires, strict=True)]

    def shutdown(self) -> None:
        for s in self.slots:
            with contextlib.suppress(Exception):
                self._kill(s)
        self.slots = []
