"""The operator's kopf session to the API server: kopf's credentials, a bounded connection pool."""

from __future__ import annotations

import asyncio
import ssl

import kopf
import pytest
from rlhf_operator import kube

pytestmark = pytest.mark.unit


def test_the_session_keeps_kopf_credentials_and_caps_its_connections() -> None:
    info = kopf.ConnectionInfo(
        server="https://127.0.0.1:6443", token="secret", insecure=True, default_namespace="research"
    )

    async def build() -> tuple[kopf.AiohttpSession, int, dict[str, str], ssl.SSLContext | bool]:
        made = kube.api_session(info, 7)
        session = made.aiohttp_session
        try:
            connector = session.connector
            assert connector is not None
            return made, connector.limit, dict(session.headers), connector._ssl  # type: ignore[attr-defined]
        finally:
            await session.close()

    made, limit, headers, context = asyncio.run(build())
    assert limit == 7
    assert made.server == "https://127.0.0.1:6443" and made.default_namespace == "research"
    assert headers["Authorization"] == "Bearer secret"
    assert isinstance(context, ssl.SSLContext) and context.verify_mode == ssl.CERT_NONE  # insecure kept
