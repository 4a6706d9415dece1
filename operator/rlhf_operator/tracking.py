"""The operator's side of spec.tracking (pure): the head pod's env from the named Secrets (never their
values), and the status the scraped rlhf_tracking_* series give: status.tracking (each sink's run) and the
TrackingHealthy condition. Must not import kopf or the Kubernetes client.
"""

from __future__ import annotations

from typing import Any

from rlhf_api.spec import RLHFJobSpec, TrackingStatus

from rlhf_operator.scrape import ScrapedMetrics

CONDITION = "TrackingHealthy"
# Each Secret's keys the driver reads (the sinks' clients read these variables natively); optional keys
# may be absent from the Secret. WANDB_API_KEY is required: an online run cannot start without it.
MLFLOW_KEYS = (
    ("MLFLOW_TRACKING_USERNAME", True),
    ("MLFLOW_TRACKING_PASSWORD", True),
    ("MLFLOW_TRACKING_TOKEN", True),
)
WANDB_KEYS = (("WANDB_API_KEY", False), ("WANDB_BASE_URL", True))


def secret_env(secret: str, keys: tuple[tuple[str, bool], ...]) -> list[dict[str, Any]]:
    """Env entries reading `keys` from `secret` (secretKeyRef: the value never enters the RayCluster)."""
    return [
        {"name": key, "valueFrom": {"secretKeyRef": {"name": secret, "key": key, "optional": optional}}}
        for key, optional in keys
    ]


def head_env(spec: RLHFJobSpec) -> list[dict[str, Any]]:
    """The tracking credentials for the head pod, where the driver (and so every sink) runs."""
    t = spec.tracking
    if t is None:
        return []
    env: list[dict[str, Any]] = []
    if t.mlflow is not None and t.mlflow.credentials_secret:
        env += secret_env(t.mlflow.credentials_secret, MLFLOW_KEYS)
    if t.wandb is not None and t.wandb.api_key_secret:
        env += secret_env(t.wandb.api_key_secret, WANDB_KEYS)
    return env


def tracking_status(m: ScrapedMetrics) -> TrackingStatus | None:
    """status.tracking from the runs the trainer reported (rlhf_tracking_run_info); None before any."""
    if not m.tracking_runs:
        return None
    runs = {sink: m.tracking_runs.get(sink) for sink in ("mlflow", "wandb", "tensorboard")}
    link = next((url for url in runs.values() if url), None)
    return TrackingStatus(
        mlflow=runs["mlflow"], wandb=runs["wandb"], tensorboard=runs["tensorboard"], link=link
    )


def health(m: ScrapedMetrics) -> tuple[bool, str, str] | None:
    """TrackingHealthy as (status, reason, message): False naming each sink whose last call failed, with
    its failed calls, dropped events and last error; None before any sink has reported a call."""
    if not m.tracking_up:
        return None
    failing = sorted(sink for sink, up in m.tracking_up.items() if up < 1)
    if not failing:
        return True, "Delivering", "every tracking sink's last call succeeded"
    parts = [
        f"{sink}: {int(m.tracking_errors.get(sink, 0))} failed calls, "
        f"{int(m.tracking_dropped.get(sink, 0))} events dropped; last error: {m.tracking_last_error.get(sink, '?')}"
        for sink in failing
    ]
    return False, "SinkFailing", "; ".join(parts) + " (training goes on; calls are retried)"
