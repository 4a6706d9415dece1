"""The one HTTP server shape the operator and the trainer expose: read-only, a fixed set of paths.

prometheus_client's own server answers every path with the metrics and leaves method checks to
http.server; ours answers GET on the named paths only (404 elsewhere, 405 for any other
method), so a port open for scraping serves nothing else (docs/security.md). Standard library only.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

WSGIApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]
READ_METHODS = frozenset({"GET"})


def guard(app: WSGIApp, paths: Iterable[str]) -> WSGIApp:
    """`app` on `paths` for GET; 404 for any other path, 405 for any other method."""
    allowed = frozenset(paths)

    def guarded(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("PATH_INFO", "") not in allowed:
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"not found\n"]
        if environ.get("REQUEST_METHOD", "") not in READ_METHODS:
            start_response("405 Method Not Allowed", [("Allow", "GET"), ("Content-Type", "text/plain")])
            return [b"read-only\n"]
        return app(environ, start_response)

    return guarded


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # scrapes every few seconds: no access log
        pass


def serve(app: WSGIApp, host: str, port: int) -> WSGIServer:
    """Serve `app` on host:port from a daemon thread; returns the server (its port, and shutdown())."""
    server = make_server(host, port, app, server_class=_Server, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name=f"http-{port}", daemon=True).start()
    return server
