"""What the run observes: watches on RayClusters and RLHFJobs (when each cluster appeared, each job's
phase and when it was Running), and the operator's writes followed in the API server's audit log.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any, cast

WRITE_VERBS = ("create", "update", "patch", "delete", "deletecollection")
Key = tuple[str, str]


def key_of(obj: dict[str, Any]) -> Key:
    return (obj["metadata"]["namespace"], obj["metadata"]["name"])


class Watcher:
    """Watches on every namespace (this process's clock): when each RayCluster first appeared, and each
    RLHFJob's phase and when it was first seen Running."""

    def __init__(self, kubeconfig: Path) -> None:
        from kubernetes import client, config

        self.api = client.CustomObjectsApi(config.new_client_from_config(config_file=str(kubeconfig)))  # type: ignore[no-untyped-call]
        self.clusters: dict[Key, float] = {}
        self.phases: dict[Key, str] = {}
        self.running: dict[Key, float] = {}
        self.cond = threading.Condition()
        self.stop = threading.Event()
        self.threads = [
            threading.Thread(target=self._run, args=("ray.io", "v1", "rayclusters"), daemon=True),
            threading.Thread(target=self._run, args=("rlhf.dev", "v1alpha1", "rlhfjobs"), daemon=True),
        ]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def _run(self, group: str, version: str, plural: str) -> None:
        """List once, then watch from there on (re-watching from the last version seen, relisting only
        when the stream breaks or the version is gone), so no periodic full list loads the API server."""
        import urllib3
        from kubernetes import watch
        from kubernetes.client.exceptions import ApiException

        rv = ""
        while not self.stop.is_set():
            try:
                if not rv:
                    listed = cast(dict[str, Any], self.api.list_cluster_custom_object(group, version, plural))
                    self._record(plural, listed["items"])
                    rv = str(listed["metadata"]["resourceVersion"])
                w = watch.Watch()  # type: ignore[no-untyped-call]
                for ev in w.stream(  # type: ignore[no-untyped-call]
                    self.api.list_cluster_custom_object,
                    group,
                    version,
                    plural,
                    resource_version=rv,
                    timeout_seconds=60,
                    allow_watch_bookmarks=True,
                ):
                    rv = str(w.resource_version or rv)
                    if ev["type"] != "BOOKMARK":
                        self._record(plural, [ev["object"]])
                    if self.stop.is_set():
                        w.stop()  # type: ignore[no-untyped-call]
            except (ApiException, OSError, ValueError, urllib3.exceptions.HTTPError):
                rv = ""  # 410 Gone or a dropped stream: list again
                time.sleep(0.2)

    def _record(self, plural: str, items: list[dict[str, Any]]) -> None:
        now = time.time()
        with self.cond:
            for obj in items:
                key = key_of(obj)
                if plural == "rayclusters":
                    self.clusters.setdefault(key, now)
                    continue
                phase = str((obj.get("status") or {}).get("phase") or "(none)")
                self.phases[key] = phase
                if phase == "Running":
                    self.running.setdefault(key, now)
            self.cond.notify_all()

    def wait_for(
        self, done: Callable[[], bool], timeout: float, what: str, check: Callable[[], None]
    ) -> None:
        """Until done() (called under the lock), calling check() each second (it raises to give up)."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while not done():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{what}: not done in {timeout:.0f}s")
                self.cond.wait(1.0)
                check()

    def seen(self, keys: list[Key]) -> Callable[[], bool]:
        return lambda: all(k in self.clusters for k in keys)

    def all_running(self, jobs: list[Key]) -> Callable[[], bool]:
        return lambda: all(self.phases.get(j) == "Running" for j in jobs)

    def summary(self, ns: str, n: int) -> str:
        """RayClusters seen, jobs Running, and the jobs' phases in a namespace (for progress lines)."""
        with self.cond:
            clusters = sum(1 for k in self.clusters if k[0] == ns)
            phases = Counter(p for k, p in self.phases.items() if k[0] == ns)
        return f"{clusters}/{n} RayClusters, {phases.get('Running', 0)}/{n} Running; phases {dict(phases)}"


class AuditTail:
    """One user's write entries from the API server's audit log, read while the server writes it. The log
    backend renames audit.log at --audit-log-maxsize (200 MB here) and keeps one old part
    (--audit-log-maxbackup=1): following the file as it grows loses nothing however often it rotates."""

    def __init__(self, path: Path, username: str) -> None:
        self.path, self.username = path, username
        self.needle = username.encode()
        self.writes: list[dict[str, Any]] = []
        self.entries = self.bytes = self.rotations = 0
        self._file: Any = None
        self._inode = 0
        self._partial = b""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Stop following and read what is left."""
        self._stop.set()
        self._thread.join()
        self.poll()
        if self._file is not None:
            self._file.close()

    def _loop(self) -> None:
        while not self._stop.wait(1.0):
            self.poll()

    def poll(self) -> None:
        """Read what was appended; after a rotation finish the renamed part, then go on with the new file."""
        if self._file is None:
            try:
                self._file = self.path.open("rb")
            except FileNotFoundError:
                return
            self._inode = os.fstat(self._file.fileno()).st_ino
        self._read()
        with contextlib.suppress(FileNotFoundError):
            if self.path.stat().st_ino != self._inode:
                self._read()  # the renamed part is complete now
                self._file.close()
                self._file, self._partial = None, b""
                self.rotations += 1
                self.poll()

    def _read(self) -> None:
        while chunk := self._file.read(16 << 20):
            self.bytes += len(chunk)
            lines = (self._partial + chunk).split(b"\n")
            self._partial = lines.pop()
            self.entries += len(lines)
            for line in lines:
                if self.needle in line:
                    self._keep(json.loads(line))

    def _keep(self, ev: dict[str, Any]) -> None:
        if ev.get("user", {}).get("username") == self.username and ev.get("verb") in WRITE_VERBS:
            ev["_t"] = datetime.fromisoformat(ev["stageTimestamp"]).timestamp()
            self.writes.append(ev)


def kind_of(ev: dict[str, Any]) -> str:
    ref = ev.get("objectRef", {})
    sub = f"/{ref['subresource']}" if ref.get("subresource") else ""
    return f"{ev['verb']} {ref.get('resource', '?')}{sub}"


def in_window(writes: list[dict[str, Any]], ns: str, t0: float, t1: float) -> list[dict[str, Any]]:
    return [e for e in writes if e.get("objectRef", {}).get("namespace") == ns and t0 <= e["_t"] <= t1]
