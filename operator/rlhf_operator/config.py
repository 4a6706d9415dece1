"""The operator's configuration: one frozen `OperatorConfig`, built from the environment once (`from_env`) by
the handlers at import, after `main` has put its arguments into the environment.

Owns the names, defaults and parsing of the operator's RLHF_* variables (the Helm chart sets them: its
deployment template); a bad value is an error naming the variable, at start-up. Must not import kopf or the
Kubernetes client. Read elsewhere, on purpose: `main`'s own flags' defaults (RLHF_LOG_FORMAT,
RLHF_LEADER_ELECTION), the leader's POD_NAME, the Ray token key file (rayjobs.token_key) and the test-only
RLHF_FAILPOINTS.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

from rlhf_api import constants

from rlhf_operator import security

T = TypeVar("T", int, float)


class ConfigError(ValueError):
    """A variable of the operator's environment holds a value it cannot use."""


@dataclass(frozen=True)
class OperatorConfig:
    # Seconds between a job's reconcile rounds (RLHF_RECONCILE_INTERVAL).
    reconcile_interval: float = 2.0
    # Development override (docs/development.md): reach every RayCluster head at this host instead of its
    # Service DNS name, because pods never run here and the Ray workload runs on a local Ray head
    # (RLHF_DEV_HEAD_HOST), its dashboard at this port (RLHF_DEV_DASHBOARD_PORT).
    dev_head_host: str = ""
    dev_dashboard_port: int = security.DASHBOARD_PORT
    # The named CPU stand-in for GPUs advertised but not real (the chart's jobDefaults.gpuStandIn): passed
    # to every job's driver, which then places on Ray's logical GPUs and computes on CPU. Empty: real GPUs.
    gpu_standin: str = ""
    # The trainer image of jobs that name none (the chart's jobDefaults.trainerImage).
    default_trainer_image: str = constants.DEFAULT_TRAINER_IMAGE
    # Who may reach a job's pods besides the job itself (the operator's namespace and labels, the metrics
    # scrapers): POD_NAMESPACE, RLHF_OPERATOR_POD_LABELS, RLHF_METRICS_FROM.
    policy_access: security.PolicyAccess = field(default_factory=lambda: security.policy_access_from_env({}))
    # kopf's thread pool for sync handlers; the API client keeps a connection for each of them, since a
    # smaller pool drops connections under load and every new one costs a TLS handshake on both sides
    # (RLHF_HANDLER_THREADS).
    handler_threads: int = 20
    # kopf's connections to the API server (its watches, status patches and Events). kopf's own session
    # has no limit, and a burst of jobs opened one TLS connection per patch in flight, 256 KiB of buffer
    # each: 470 of them at once with 300 jobs (docs/benchmarks.md, operator_scale.py, Round 3). Past the
    # limit a request waits for a free connection; the watches (one per kind) hold one each, hence the
    # floor of 8 (RLHF_API_CONNECTIONS).
    api_connections: int = 64
    # How long kopf keeps an object's event worker after its last event (kopf's default: 5 s). An idle
    # worker holds the object's last event, a whole object, so in a burst kopf kept about one of every
    # watched job, RayCluster and pod; a new event after it exits starts a new worker
    # (RLHF_WORKER_IDLE_SECONDS).
    worker_idle_seconds: float = 0.5
    # Calls to Ray heads (Jobs API, trainer /metrics) in flight at once, in all and to one host
    # (RLHF_REMOTE_CONCURRENCY, RLHF_REMOTE_PER_HOST; throttle.RemoteLimiter).
    remote_concurrency: int = 8
    remote_per_host: int = 2
    # The operator's own /metrics (RLHF_OPERATOR_METRICS_PORT, 0: none; RLHF_OPERATOR_METRICS_ADDR).
    metrics_port: int = 8000
    metrics_addr: str = "127.0.0.1"

    @property
    def head_keepalive(self) -> float:
        """How long a job's idle connections to its head (Jobs API, trainer /metrics) stay open: past its
        next round, so each round reuses them. httpx's default, 5 s, closed them between rounds at any
        interval over 5 s (docs/results/2026-11-28-operator-scale-1000-connections.md)."""
        return 2 * self.reconcile_interval + 5.0

    @property
    def unseen_write_grace(self) -> float:
        """How long a write of ours may stay unseen by the watch (expectations.py)."""
        return max(15.0, 5 * self.reconcile_interval)


def from_env(env: Mapping[str, str] | None = None) -> OperatorConfig:
    """The configuration from `env` (the process's environment by default); unset or blank: the default."""
    env = os.environ if env is None else env
    default = OperatorConfig()
    try:
        access = security.policy_access_from_env(env)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    return OperatorConfig(
        reconcile_interval=_number(env, "RLHF_RECONCILE_INTERVAL", float, default.reconcile_interval, 0.001),
        dev_head_host=_text(env, "RLHF_DEV_HEAD_HOST"),
        dev_dashboard_port=_number(env, "RLHF_DEV_DASHBOARD_PORT", int, default.dev_dashboard_port, 1),
        gpu_standin=_text(env, "RLHF_GPU_STANDIN"),
        default_trainer_image=_text(env, "RLHF_DEFAULT_TRAINER_IMAGE") or default.default_trainer_image,
        policy_access=access,
        handler_threads=_number(env, "RLHF_HANDLER_THREADS", int, default.handler_threads, 1),
        api_connections=max(8, _number(env, "RLHF_API_CONNECTIONS", int, default.api_connections, 1)),
        worker_idle_seconds=_number(env, "RLHF_WORKER_IDLE_SECONDS", float, default.worker_idle_seconds, 0),
        remote_concurrency=_number(env, "RLHF_REMOTE_CONCURRENCY", int, default.remote_concurrency, 1),
        remote_per_host=_number(env, "RLHF_REMOTE_PER_HOST", int, default.remote_per_host, 1),
        metrics_port=_number(env, "RLHF_OPERATOR_METRICS_PORT", int, default.metrics_port, 0),
        metrics_addr=_text(env, "RLHF_OPERATOR_METRICS_ADDR") or default.metrics_addr,
    )


def _text(env: Mapping[str, str], name: str) -> str:
    return env.get(name, "").strip()


def _number(env: Mapping[str, str], name: str, kind: Callable[[str], T], default: T, least: T) -> T:
    raw = _text(env, name)
    if not raw:
        return default
    try:
        value = kind(raw)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise ConfigError(f"{name}={raw!r} is not {what}") from None
    if value < least:
        raise ConfigError(f"{name}={raw!r} must be at least {least}")
    return value
