"""The operator's Kubernetes clients: the client library's (`api`, `custom`), and kopf's own session, of at
most RLHF_API_CONNECTIONS connections; the RayCluster API's names and a refusal's words.

Must not decide anything: callers say what to read or write.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, cast

import aiohttp
import kopf
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException

from rlhf_operator import runtime

RAY_GROUP, RAY_VERSION, RAY_PLURAL = "ray.io", "v1", "rayclusters"
JSON_PATCH = "application/json-patch+json"
# Threads beside kopf's handler threads that call the API server (children's pool for the security objects
# that follow a RayCluster); the client keeps a connection for each thread of both.
BACKGROUND_THREADS = 8
_api: k8s.ApiClient | None = None


def api() -> k8s.ApiClient:
    global _api
    if _api is None:
        try:
            k8s_config.load_incluster_config()  # type: ignore[no-untyped-call]
        except k8s_config.ConfigException:
            k8s_config.load_kube_config()  # type: ignore[no-untyped-call]
        cfg = k8s.Configuration.get_default_copy()
        cfg.connection_pool_maxsize = runtime.CONFIG.handler_threads + BACKGROUND_THREADS
        _api = k8s.ApiClient(cfg)
    return _api


def custom() -> k8s.CustomObjectsApi:
    return k8s.CustomObjectsApi(api())


@kopf.on.login()
async def login(logger: kopf.Logger, settings: kopf.OperatorSettings, **_: Any) -> kopf.AiohttpSession | None:
    """kopf's own login (in-cluster, else kubeconfig), on a session of at most RLHF_API_CONNECTIONS connections."""
    info = await asyncio.to_thread(kopf.login_via_client, logger=logger, settings=settings)
    return None if info is None else api_session(info, runtime.CONFIG.api_connections)


def api_session(info: kopf.ConnectionInfo, connections: int) -> kopf.AiohttpSession:
    """The session kopf would make for `info`, but of at most `connections` connections (in the loop)."""
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=connections, ssl=info.as_ssl_context()),
        headers=info.as_http_headers(),
        proxy=info.proxy_url,
        trust_env=info.trust_env,
    )
    return kopf.AiohttpSession(
        server=info.server,
        default_namespace=info.default_namespace,
        expiration=info.expiration,
        priority=info.priority,
        aiohttp_session=session,
    )


def api_message(e: ApiException) -> str:
    """The server's own words (the Status object's message), else the HTTP reason."""
    try:
        return str(json.loads(e.body or "{}").get("message") or e.reason)
    except (ValueError, AttributeError):
        return str(e.reason)


def read_cluster(namespace: str, name: str) -> dict[str, Any] | None:
    try:
        obj = custom().get_namespaced_custom_object(RAY_GROUP, RAY_VERSION, namespace, RAY_PLURAL, name)
        return cast(dict[str, Any], obj)
    except ApiException as e:
        if e.status == 404:
            return None
        raise
