"""Who may reach a job's Ray cluster: its token, the Secret that carries it, its NetworkPolicy. Pure functions.

Every job gets its own Ray token, derived from the operator's key and the job's uid (HMAC-SHA256), so the
operator knows each token without reading any Secret: it creates the job's Secret and never reads one
back (docs/security.md, docs/chart.md). The pods take the token from that Secret by reference.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlhf_api.spec import RLHFJob

TOKEN_SECRET_KEY = "token"
TOKEN_DERIVATION = "rlhf-operator/ray-token/v1"
# What a job's NetworkPolicy admits from outside the job, besides the job's own pods (docs/security.md).
DASHBOARD_PORT = 8265  # Ray dashboard and Jobs API, on the head


def job_token(key: bytes, namespace: str, name: str, uid: str) -> str:
    """The job's Ray token: HMAC-SHA256 of its identity under the operator's key, hex.

    The uid makes it one job's: a job deleted and created again under the same name gets another token.
    """
    if not key:
        raise ValueError("job_token: empty key")
    message = f"{TOKEN_DERIVATION}/{namespace}/{name}/{uid}".encode()
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def _uid(job: RLHFJob) -> str:
    uid = str(job.metadata.get("uid") or "")
    if not uid:
        raise ValueError(f"RLHFJob {job.name} has no uid: only a stored object has a token")
    return uid


def token_of(key: bytes, job: RLHFJob) -> str:
    """`job_token` of a stored job."""
    return job_token(key, job.namespace or "default", job.name, _uid(job))


def token_secret_name(job: RLHFJob) -> str:
    """Deterministic (a restarted operator creates the same name), and one job's (the uid's first 8 hex),
    so a job created again under the same name never meets the Secret of the one before it. A job not yet
    stored (a rendered preview) shows `<uid>` in its place."""
    uid = str(job.metadata.get("uid") or "")
    return f"{job.name[:200]}-ray-token-{uid[:8] if uid else '<uid>'}"


def token_enabled(job: RLHFJob) -> bool:
    return job.spec.security.ray_authentication == "Token"


def auth_env(job: RLHFJob) -> list[dict[str, Any]]:
    """The Ray containers' authentication env: token mode with the token from the job's Secret, or
    authentication off said explicitly (Ray turns token mode on by itself when ~/.ray/auth_token exists)."""
    if not token_enabled(job):
        return [{"name": "RAY_AUTH_MODE", "value": "disabled"}]
    return [
        {"name": "RAY_AUTH_MODE", "value": "token"},
        {
            "name": "RAY_AUTH_TOKEN",
            "valueFrom": {"secretKeyRef": {"name": token_secret_name(job), "key": TOKEN_SECRET_KEY}},
        },
    ]


def token_secret(metadata: Mapping[str, Any], token: str) -> dict[str, Any]:
    """The Secret the pods read the token from (`metadata` names it `token_secret_name`; owner reference
    added by the caller)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": dict(metadata),
        "type": "Opaque",
        "immutable": True,
        "stringData": {TOKEN_SECRET_KEY: token},
    }


def creation_order(
    objects: Sequence[dict[str, Any]],
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Which of a job's security objects (manifests.security_objects) to create before its RayCluster, and
    which after it, in this order.

    With a token Secret the RayCluster goes first, so no round trip stands before it: no Ray container can
    start before the Secret exists (each reads RAY_AUTH_TOKEN by a secretKeyRef that is not optional, and the
    kubelet creates no container whose Secret is missing), and the NetworkPolicy is created before the
    Secret, so it exists before any Ray process of the job can. Without a Secret (token authentication off)
    nothing holds the pods back, so the NetworkPolicy stays before the RayCluster.
    """
    if not any(obj["kind"] == "Secret" for obj in objects):
        return list(objects), []
    return [], sorted(objects, key=lambda obj: obj["kind"] == "Secret")  # stable: the Secret last


@dataclass(frozen=True)
class PolicyAccess:
    """Who, outside a job, may reach its pods: the operator's pods (by namespace and labels), and the
    metrics scrapers (NetworkPolicy peers; empty means every pod of the job's namespace)."""

    operator_namespace: str
    operator_pod_labels: Mapping[str, str]
    metrics_from: tuple[Mapping[str, Any], ...] = field(default=())


def policy_access_from_env(env: Mapping[str, str]) -> PolicyAccess:
    """The operator's own identity and the configured scrapers, from its environment (set by the chart):
    POD_NAMESPACE, RLHF_OPERATOR_POD_LABELS (a JSON object), RLHF_METRICS_FROM (a JSON list of peers)."""
    labels = _json_env(env, "RLHF_OPERATOR_POD_LABELS", "{}")
    peers = _json_env(env, "RLHF_METRICS_FROM", "[]")
    if not isinstance(labels, dict) or not all(isinstance(v, str) for v in labels.values()):
        raise ValueError("RLHF_OPERATOR_POD_LABELS must be a JSON object of strings")
    if not isinstance(peers, list) or not all(isinstance(p, dict) for p in peers):
        raise ValueError("RLHF_METRICS_FROM must be a JSON list of NetworkPolicy peers")
    if not labels:  # not in a pod (a development run): the chart's default selector labels
        labels = {"app.kubernetes.io/name": "rlhf-operator"}
    return PolicyAccess(
        operator_namespace=env.get("POD_NAMESPACE") or "rlhf-system",
        operator_pod_labels=labels,
        metrics_from=tuple(peers),
    )


def _json_env(env: Mapping[str, str], name: str, default: str) -> Any:
    """A variable holding JSON (unset or blank: `default`); a ValueError naming it when it is not JSON."""
    try:
        return json.loads(env.get(name, "").strip() or default)
    except ValueError as e:
        raise ValueError(f"{name} is not JSON: {e}") from None


def _tcp(*ports: int) -> list[dict[str, Any]]:
    return [{"protocol": "TCP", "port": p} for p in ports]


def network_policy(
    job: RLHFJob, metadata: Mapping[str, Any], job_selector: Mapping[str, str], access: PolicyAccess
) -> dict[str, Any]:
    """Ingress to the job's pods: anything from the job's own pods (Ray's GCS, raylets, object stores);
    the Jobs API and metrics ports from the operator's pods; the metrics port from the scrapers.
    Egress is left open (reward endpoints, object stores and registries are the job's business)."""
    metrics_port = job.spec.monitoring.metrics_port
    operator_peer = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": access.operator_namespace}},
        "podSelector": {"matchLabels": dict(access.operator_pod_labels)},
    }
    scrapers = [dict(p) for p in access.metrics_from] or [{"podSelector": {}}]
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": dict(metadata),
        "spec": {
            "podSelector": {"matchLabels": dict(job_selector)},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [{"podSelector": {"matchLabels": dict(job_selector)}}]},
                {"from": [operator_peer], "ports": _tcp(DASHBOARD_PORT, metrics_port)},
                {"from": scrapers, "ports": _tcp(metrics_port)},
            ],
        },
    }


def disabled_warnings(job: RLHFJob) -> list[str]:
    """One line per protection the job turned off (each becomes a Warning Event)."""
    sec = job.spec.security
    out = []
    if sec.ray_authentication == "Disabled":
        out.append(
            "spec.security.rayAuthentication is Disabled: whoever reaches the Ray head's ports (8265, 6379, "
            "10001) can run code as the trainer, with its volumes and credentials"
        )
    if sec.network_policy == "Disabled":
        out.append(
            "spec.security.networkPolicy is Disabled: no NetworkPolicy fences the job's pods; every pod in "
            "the cluster can reach them"
        )
    return out
