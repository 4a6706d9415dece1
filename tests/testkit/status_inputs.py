"""Inputs of the operator's pure status decision (rlhf_operator.status.decide) for the unit tests: the tiny
example as a job with a given status and run policy, a RayCluster in a given state, a Ray job record, and
the observation that bundles them at a fixed time. Shared by the status, stall, provisioning and Kueue
status tests."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import yaml
from rlhf_api.spec import RLHFJob
from rlhf_operator.rayjobs import RayJobInfo
from rlhf_operator.status import Observed

ROOT = Path(__file__).resolve().parents[2]
NOW = datetime(2026, 11, 23, 12, 0, 0, tzinfo=UTC)
SID = "rlhf-ns-tiny-0123abcd-0"


def job(status: dict[str, Any] | None = None, **run_policy: Any) -> RLHFJob:
    doc = yaml.safe_load((ROOT / "examples" / "rlhfjob-tiny.yaml").read_text())
    doc["metadata"].update(namespace="ns", uid="0123abcd-ffff", generation=1)
    doc["spec"].setdefault("runPolicy", {}).update(run_policy)
    if status:
        doc["status"] = status
    return RLHFJob.model_validate(doc)


def running_job(on_stall: str, snapshot: int = 0, **status: Any) -> RLHFJob:
    """A job running for 8 hours (attempt SID) with onStall `on_stall`, stallTimeoutSeconds 600 and
    stackSnapshotTimeoutSeconds `snapshot` (0: no stack snapshot); `status` adds to or replaces fields."""
    base = {"phase": "Running", "startTime": NOW - timedelta(hours=8), "restarts": 0, "submissionId": SID}
    base = {k: v.strftime("%Y-%m-%dT%H:%M:%SZ") if isinstance(v, datetime) else v for k, v in base.items()}
    j = job({**base, **status})
    doc = j.model_dump(by_alias=True, exclude_none=True, mode="json")
    doc["spec"]["monitoring"].update(
        stallTimeoutSeconds=600, onStall=on_stall, stackSnapshotTimeoutSeconds=snapshot
    )
    return RLHFJob.model_validate(doc)


def raycluster_in(state: str | None = "ready", suspend: bool = False, **status: Any) -> dict[str, Any]:
    """The job's RayCluster in `state` (None: none yet), suspended or not; `status` adds to its status."""
    st: dict[str, Any] = dict(status)
    if state:
        st["state"] = state
    return {"metadata": {"name": "tiny", "namespace": "ns"}, "spec": {"suspend": suspend}, "status": st}


def ray(status: str, sid: str = SID, message: str = "", exit_code: int | None = None) -> RayJobInfo:
    return RayJobInfo(sid, status, message, None, None, exit_code)


def obs(**kw: Any) -> Observed:
    kw.setdefault("raycluster", raycluster_in())
    return Observed(now=kw.pop("now", NOW), uid="0123abcd-ffff", **kw)


def remote_job(status: dict[str, Any] | None = None) -> RLHFJob:
    """The tiny job with its actor on the Hub (hf://), so the head pod has a fetch-models step."""
    doc = job(status).model_dump(by_alias=True, exclude_none=True, mode="json")
    doc["spec"]["model"]["actor"] = "hf://org/tiny@v1"
    doc["spec"]["storage"] = {"modelCache": {"claimName": "models"}}
    return RLHFJob.model_validate(doc)


def head_pod(fetch_status: dict[str, Any] | None) -> dict[str, Any]:
    """A head pod of the job's RayCluster whose fetch-models init container is in `fetch_status`."""
    statuses = [{"name": "fetch-models", **fetch_status}] if fetch_status is not None else []
    return {
        "metadata": {"name": "tiny-head-x", "labels": {"ray.io/node-type": "head"}},
        "status": {"phase": "Pending", "initContainerStatuses": statuses},
    }


def fetch_failed(reason: str, exit_code: int = 2, restarted: bool = False) -> dict[str, Any]:
    """A fetch-models container that ended with `reason` in its termination message (as the fetcher writes
    it); `restarted`: the kubelet is about to run it again (the failure in lastState)."""
    message = json.dumps({"reason": reason, "field": "model.actor", "message": f"spec.model.actor: {reason}"})
    terminated = {"terminated": {"exitCode": exit_code, "message": message, "reason": "Error"}}
    if restarted:
        return {"state": {"waiting": {"reason": "CrashLoopBackOff"}}, "lastState": terminated}
    return {"state": terminated}
