"""Read-your-writes for one job: the writes this operator made that its cache (kopf's watch and indexes) has
not shown yet, as KubeRay's `expectations` package keeps them for its controllers.

kopf hands a round the latest body or index entry its watch has delivered, which under load (100 jobs on
2 CPUs) can predate this operator's own last write by seconds. Deciding on it repeats the write and its
Event, and two rounds on bodies of different ages rewrite the conditions back and forth
(benchmarks/operator_scale.py). So each write is expected until an observation shows it, for at most
`grace` seconds, after which the round runs as before (a write that never shows is redone).
Pure: no kopf, no Kubernetes client; the clock is injected for the tests.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

DEFAULT_GRACE_SECONDS = 15.0


@dataclass(slots=True)
class Expectations:
    """One job's unseen writes: its last status write, its RayCluster's creation, its last RayCluster patch."""

    grace: float = DEFAULT_GRACE_SECONDS
    clock: Callable[[], float] = time.monotonic
    # The status fields last written and when.
    status: tuple[dict[str, Any], float] | None = None
    # The RayCluster as created (slimmed, as the index keeps it) and when.
    cluster: tuple[dict[str, Any], float] | None = None
    # The RayCluster's resourceVersion when last patched, and when.
    patched: tuple[str, float] | None = None

    def wrote_status(self, fields: Mapping[str, Any]) -> None:
        """The status fields just written (nothing is expected of an empty write)."""
        if fields:
            self.status = (dict(fields), self.clock())

    def expects_status(self) -> bool:
        return self.status is not None

    def status_unseen(self, current: Mapping[str, Any]) -> bool:
        """True while `current` (the status as observed) lacks the fields last written, within the grace;
        a status that shows them, or the grace's end, satisfies the expectation and drops it."""
        if self.status is None:
            return False
        fields, at = self.status
        if self.clock() - at > self.grace or all(current.get(k) == v for k, v in fields.items()):
            self.status = None
            return False
        return True

    def created_cluster(self, cluster: dict[str, Any]) -> None:
        """The RayCluster just created (or found made by an earlier incarnation)."""
        self.cluster = (cluster, self.clock())

    def cluster_seen(self, indexed: dict[str, Any] | None) -> dict[str, Any] | None:
        """The RayCluster to act on: the index's when it has one (which satisfies the creation), else the
        one created, for at most the grace, so a round does not take a cluster just made for a missing one."""
        if indexed is not None:
            self.cluster = None
            return indexed
        made = self.cluster
        if made is not None and self.clock() - made[1] < self.grace:
            return made[0]
        self.cluster = None
        return None

    def patched_cluster(self, version: str) -> None:
        """The RayCluster was just patched while at `version`."""
        self.patched = (version, self.clock())

    def patch_in_flight(self, version: str | None) -> bool:
        """True while the RayCluster seen is still at the version last patched, within the grace: the patch
        has not come back through the watch, and sending it again would write the same change twice."""
        at = self.patched
        return at is not None and at[0] == version and self.clock() - at[1] < self.grace

    def cluster_deleted(self) -> None:
        """The RayCluster is being deleted: no patch of it is expected any more."""
        self.patched = None
