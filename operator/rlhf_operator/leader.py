"""Leader election on a `coordination.k8s.io/v1` Lease, so that of several operator replicas only one acts.

The rules are client-go's: a replica may take the Lease when it is free (no holder), already its own,
or expired (not renewed within `leaseDurationSeconds`); it writes with the Lease's resourceVersion, so
of two replicas racing for it exactly one wins. The leader renews every `retry` seconds and exits at
once when it cannot renew within `renew_deadline` (or sees another holder): a replica that may have
lost the Lease must stop acting before another can take it (renew_deadline < lease_duration). On a
clean shutdown it releases the Lease, so a follower takes over within `retry` seconds instead of the
lease duration. The decisions are election.py's (pure); this module does the I/O.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlparse
from wsgiref.simple_server import WSGIServer

from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException
from rlhf_api import read_only_http

from rlhf_operator.election import Lease, can_take, from_spec, released, taken, to_spec
from rlhf_operator.kube import api

log = logging.getLogger("rlhf_operator.leader")

LEASE_NAME = "rlhf-operator-leader"
RENEW_DEADLINE_SECONDS = 10
RETRY_SECONDS = 2


def identity() -> str:
    """This replica's name: the pod's (POD_NAME from the downward API), else host and pid."""
    return os.environ.get("POD_NAME") or f"{socket.gethostname()}-{os.getpid()}"


class LeaderElector:
    """Takes the Lease (blocking until it has it), renews it in a thread, releases it on `release()`.

    `on_lost` is called from the renew thread when leadership is lost; the default exits the process
    at once (the pod restarts as a follower), since a replica unsure of its lease must not go on acting.
    """

    def __init__(
        self,
        namespace: str,
        name: str = LEASE_NAME,
        me: str | None = None,
        on_lost: Callable[[str], None] | None = None,
    ) -> None:
        self.api = k8s.CoordinationV1Api(api())
        self.namespace = namespace
        self.name = name
        self.me = me or identity()
        self.on_lost = on_lost or _exit
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_renew = 0.0

    def _read(self) -> tuple[Lease | None, str | None]:
        try:
            obj = self.api.read_namespaced_lease(self.name, self.namespace)
        except ApiException as e:
            if e.status == 404:
                return None, None
            raise
        spec = self.api.api_client.sanitize_for_serialization(obj.spec) or {}
        return from_spec(spec), obj.metadata.resource_version if obj.metadata else None

    def _write(self, lease: Lease, version: str | None) -> bool:
        """Create or replace (with `version`): False when another replica wrote first (409)."""
        # A plain body (the client takes one): times in the MicroTime form the API server parses.
        metadata: dict[str, str] = {"name": self.name, "namespace": self.namespace}
        if version is not None:
            metadata["resourceVersion"] = version
        body: Any = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": metadata,
            "spec": to_spec(lease),
        }
        try:
            if version is None:
                self.api.create_namespaced_lease(self.namespace, body)
            else:
                self.api.replace_namespaced_lease(self.name, self.namespace, body)
            return True
        except ApiException as e:
            if e.status == 409:
                return False
            raise

    def try_take(self) -> bool:
        lease, version = self._read()
        now = datetime.now(UTC)
        if not can_take(lease, self.me, now):
            return False
        return self._write(taken(lease, self.me, now), version)

    def acquire(self) -> None:
        """Block until this replica holds the Lease, then renew it in the background."""
        waiting_logged = False
        while True:
            try:
                if self.try_take():
                    break
            except Exception as e:  # the API server may be restarting: keep trying
                log.warning("leader election: %s", e)
            if not waiting_logged:
                lease, _ = self._read_quietly()
                holder = lease.holder if lease else None
                log.info(
                    "leader election: %s waits; Lease %s/%s held by %s",
                    self.me,
                    self.namespace,
                    self.name,
                    holder,
                )
                waiting_logged = True
            time.sleep(RETRY_SECONDS)
        self._last_renew = time.monotonic()
        log.info("leader election: %s is the leader (Lease %s/%s)", self.me, self.namespace, self.name)
        self._thread = threading.Thread(target=self._renew_loop, name="lease-renew", daemon=True)
        self._thread.start()

    def _read_quietly(self) -> tuple[Lease | None, str | None]:
        try:
            return self._read()
        except Exception:
            return None, None

    def _renew_loop(self) -> None:
        while not self._stop.wait(RETRY_SECONDS):
            try:
                lease, version = self._read()
                if lease is not None and lease.holder not in (None, self.me):
                    self.on_lost(f"the Lease is held by {lease.holder}")
                    return
                if self._write(taken(lease, self.me, datetime.now(UTC)), version):
                    self._last_renew = time.monotonic()
            except Exception as e:
                log.warning("leader election: renewing: %s", e)
            if time.monotonic() - self._last_renew > RENEW_DEADLINE_SECONDS:
                self.on_lost(f"not renewed for {RENEW_DEADLINE_SECONDS}s")
                return

    def release(self) -> None:
        """Stop renewing and give the Lease up, if still held (best effort: it expires anyway)."""
        self._stop.set()
        try:
            lease, version = self._read()
            if lease is not None and lease.holder == self.me:
                self._write(released(lease), version)
                log.info("leader election: %s released the Lease", self.me)
        except Exception as e:
            log.warning("leader election: releasing: %s", e)


def _exit(why: str) -> None:
    log.error("leader election: leadership lost (%s): exiting so as not to act beside the new leader", why)
    logging.shutdown()
    os._exit(3)


def _standby(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"standby: waiting for the leader Lease\n"]


def standby_health(liveness_url: str | None) -> WSGIServer | None:
    """Answer the liveness and readiness probes while this replica waits for the Lease (kopf serves
    them once it runs): a follower is healthy, not a crash loop. Shut it down before kopf starts.
    Like kopf's endpoint, it serves GET on the liveness path only."""
    if not liveness_url:
        return None
    parsed = urlparse(liveness_url)
    app = read_only_http.guard(_standby, [parsed.path or "/"])
    return read_only_http.serve(app, parsed.hostname or "0.0.0.0", parsed.port or 80)
