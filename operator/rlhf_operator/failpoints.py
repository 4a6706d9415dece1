"""Named crash points for fault-injection tests: the operator SIGKILLs itself at a chosen point.

Inert unless RLHF_FAILPOINTS names the point (comma-separated). Each point fires once per marker
directory (RLHF_FAILPOINTS_DIR), so the restarted operator runs past it and must converge.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

POINTS = (
    "after_cluster_create",  # RayCluster created, status not yet patched
    "before_submit",  # about to submit the trainer's Ray job
    "after_submit",  # Ray job submitted, status not yet patched
    "after_restart_decision",  # a failed attempt seen, restart not yet recorded
    "before_status_patch",  # every action done, status patch not yet sent
)


def hit(point: str) -> None:
    armed = os.environ.get("RLHF_FAILPOINTS", "")
    if not armed or point not in armed.split(","):
        return
    marker_dir = Path(os.environ.get("RLHF_FAILPOINTS_DIR", "/tmp/rlhf-failpoints"))
    marker_dir.mkdir(parents=True, exist_ok=True)
    marker = marker_dir / point
    if marker.exists():
        return
    marker.write_text(str(os.getpid()))
    os.kill(os.getpid(), signal.SIGKILL)
