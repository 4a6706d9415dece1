"""The stand-in Ray head every job's RayCluster points at (the development head override): the Ray
Jobs REST API and an unchanging trainer /metrics, for all jobs at once, in a child process.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


def trainer_metrics(started: float) -> str:
    """A trainer mid-run (step 3 of 20, generating), unchanging: any status write after the first scrape
    is the operator's own churn, not progress."""
    return "\n".join(
        [
            "rlhf_steps_completed_total 3",
            "rlhf_total_steps 20",
            f"rlhf_last_step_completed_timestamp_seconds {started:.3f}",
            "rlhf_stall_timeout_seconds 3600",
            'rlhf_step_phase_seconds{phase="generation"} 4.25',
            'rlhf_step_phase_seconds{phase="train"} 2.5',
            'rlhf_phase_in_progress{phase="generation"} 1',
            f'rlhf_phase_started_timestamp_seconds{{phase="generation"}} {started + 1:.3f}',
            "rlhf_generated_tokens_total 12288",
            "rlhf_trained_tokens_total 12288",
            "rlhf_reward_mean 0.45",
            "rlhf_kl 0.0012",
            'rlhf_rollout_engines{state="ready"} 1',
            "",
        ]
    )


def serve_stand_in(port: int) -> None:
    """The Ray Jobs REST API (submit, get, stop) and the trainer's /metrics, for every job at once."""
    jobs: dict[str, dict[str, Any]] = {}
    lock = threading.Lock()
    metrics_body = trainer_metrics(time.time()).encode()

    class Handler(BaseHTTPRequestHandler):
        # Connections stay open between requests, as the Ray dashboard's (aiohttp) and the driver's do:
        # HTTP/1.0 closed each after one answer, whatever the operator kept.
        protocol_version = "HTTP/1.1"

        def _reply(self, code: int, body: bytes, ctype: str = "application/json") -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            if self.path == "/metrics":
                self._reply(200, metrics_body, "text/plain; version=0.0.4")
                return
            sid = self.path.removeprefix("/api/jobs/").strip("/")
            with lock:
                job = jobs.get(sid)
            if job is None:
                self._reply(404, b'{"detail": "not found"}')
            else:
                self._reply(200, json.dumps(job).encode())

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
            if self.path.endswith("/stop"):
                self._reply(200, b'{"stopped": true}')
                return
            sid = str(body.get("submission_id"))
            with lock:
                jobs.setdefault(
                    sid,
                    {
                        "submission_id": sid,
                        "status": "RUNNING",
                        "message": "",
                        "start_time": time.time() * 1e3,
                    },
                )
            self._reply(200, json.dumps({"submission_id": sid}).encode())

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    server.daemon_threads = True  # a thread per open connection: up to two per job
    print("READY", flush=True)
    server.serve_forever()
