"""The typed outcome of one round's decision (`status.decide`): the next status, the actions to carry out in
order, and the Events to emit. Pure data: no I/O; `act.py` carries the actions out and the handler patches
the status diff. Must not import kopf or the Kubernetes client.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, ClassVar, NamedTuple, TypeVar

from rlhf_api.spec import RLHFJobStatus

from rlhf_operator.scaling import Direction
from rlhf_operator.stall import Stall


@dataclass(frozen=True)
class CreateCluster:
    """Create the job's RayCluster (it is missing)."""

    kind: ClassVar[str] = "create_cluster"


@dataclass(frozen=True)
class AwaitCreateBackoff:
    """Nothing this round, not even a status write: a transient refusal's backoff holds the create, and the
    status already says why (children.refused)."""

    kind: ClassVar[str] = "await_create_backoff"


@dataclass(frozen=True)
class SubmitTrainer:
    """Submit the trainer entrypoint as Ray job `submission_id` (the current attempt's id)."""

    submission_id: str
    kind: ClassVar[str] = "submit"


@dataclass(frozen=True)
class StopRayJob:
    """Ask the head to stop Ray job `submission_id` (it finishes its step and may save a checkpoint)."""

    submission_id: str
    kind: ClassVar[str] = "stop"


@dataclass(frozen=True)
class SetClusterSuspend:
    """Set the RayCluster's spec.suspend (never for a Kueue-managed cluster: that field is Kueue's)."""

    suspend: bool
    kind: ClassVar[str] = "suspend_cluster"


@dataclass(frozen=True)
class DeleteCluster:
    """Delete the RayCluster: a finished job releases its GPUs; a restart or a queued suspend gets new pods."""

    kind: ClassVar[str] = "delete_cluster"


@dataclass(frozen=True)
class DeleteJob:
    """Delete the RLHFJob itself: runPolicy.ttlSecondsAfterFinished has elapsed."""

    kind: ClassVar[str] = "delete_job"


@dataclass(frozen=True)
class SubmitSnapshot:
    """Submit the stall's stack snapshot as Ray job `submission_id` (status.diagnosis says which)."""

    submission_id: str
    kind: ClassVar[str] = "snapshot"


@dataclass(frozen=True)
class StopSnapshot:
    """Stop the stack snapshot's Ray job `submission_id` (past its time limit)."""

    submission_id: str
    kind: ClassVar[str] = "stop_snapshot"


@dataclass(frozen=True)
class RecordStacks:
    """Write the snapshot into the ConfigMap <job>-stacks."""

    stacks: dict[str, Any]
    kind: ClassVar[str] = "record_stacks"


@dataclass(frozen=True)
class WriteEngines:
    """Set spec.rollout.engines from `requested` to `engines` (a clamp or the autoscaler's decision, moving
    `direction`), with a JSON-patch test on `requested`: a concurrent `kubectl scale` wins, and the round is
    planned again (act.Replan)."""

    requested: int
    engines: int
    direction: Direction | None
    kind: ClassVar[str] = "write_engines"


@dataclass(frozen=True)
class ScaleRolloutGroup:
    """JSON-patch the RayCluster's rollout worker group to `replicas` workers (manifests.scale_patch)."""

    replicas: int
    ops: tuple[dict[str, Any], ...]
    kind: ClassVar[str] = "scale_rollout"


Action = (
    CreateCluster
    | AwaitCreateBackoff
    | SubmitTrainer
    | StopRayJob
    | SetClusterSuspend
    | DeleteCluster
    | DeleteJob
    | SubmitSnapshot
    | StopSnapshot
    | RecordStacks
    | WriteEngines
    | ScaleRolloutGroup
)
A = TypeVar("A", bound=Action)


class Event(NamedTuple):
    """A Kubernetes Event about the job: type (Normal or Warning), CamelCase reason, message."""

    type: str
    reason: str
    message: str


def event(reason: str, message: str, warning: bool = False) -> Event:
    return Event("Warning" if warning else "Normal", reason, message)


@dataclass(frozen=True)
class Decision:
    """One round's outcome. `next` is the typed status; `status` its wire form (camelCase, None left out),
    made once, which the handler diffs against the stored status."""

    next: RLHFJobStatus
    actions: tuple[Action, ...] = ()
    events: tuple[Event, ...] = ()
    new_stall: Stall | None = None  # a stall first seen (or first attributed to a step phase) this round

    @cached_property
    def status(self) -> dict[str, Any]:
        return self.next.model_dump(by_alias=True, exclude_none=True, mode="json")

    @property
    def action_kinds(self) -> list[str]:
        """The actions' kinds in order (`create_cluster`, `submit`, ...)."""
        return [a.kind for a in self.actions]

    def find(self, cls: type[A]) -> A | None:
        """The first action of type `cls`, if any."""
        return next((a for a in self.actions if isinstance(a, cls)), None)

    @property
    def holds_round(self) -> bool:
        """Whether the round does nothing at all (AwaitCreateBackoff)."""
        return any(isinstance(a, AwaitCreateBackoff) for a in self.actions)
