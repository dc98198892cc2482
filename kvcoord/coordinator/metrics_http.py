"""The /metrics HTTP endpoint: one registry exposed on its own thread, closed fast on shutdown."""

from __future__ import annotations

import socket
import threading
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

SHUTDOWN_POLL = 0.05
"""Seconds between the metrics server's shutdown checks (bounds how long ``close`` waits)."""


class _QuietHandler(WSGIRequestHandler):
    """No access log line per scrape."""

    def log_message(self, format: str, *args: Any) -> None:
        pass


class MetricsEndpoint:
    """Serves one registry's /metrics."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self._http: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    def serve(self, host: str, port: int) -> int:
        """Start the /metrics HTTP server on a daemon thread; returns the bound port.

        Not prometheus-client's ``start_http_server``: its thread polls for shutdown every 0.5 s, so
        closing it would take up to half a second of a SIGTERM's budget. This one polls every 50 ms.
        """

        class Server(ThreadingWSGIServer):
            address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

        server = make_server(host, port, make_wsgi_app(self.registry), Server, handler_class=_QuietHandler)
        thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": SHUTDOWN_POLL}, name="kvcoord-metrics",
            daemon=True,
        )
        thread.start()
        self._http, self._thread = server, thread
        return int(server.server_address[1])

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
        if self._thread is not None:
            self._thread.join(timeout=1.0)
            self._thread = None
