"""`moed serve --metrics-port P`: the Prometheus text on http://127.0.0.1:P/metrics for a scraper.

Loopback only (the socket's owner-only rule has no HTTP twin; keep it off the network). Bounded:
at most MAX_CONNECTIONS at once (more are closed at accept) and a socket timeout on each, so
half-open or idle connections cannot pile up; served by daemon threads that never hold up exit.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from moed.daemon.telemetry.metrics import CONTENT_TYPE

log = logging.getLogger("moed.telemetry")

MAX_CONNECTIONS = 16
TIMEOUT_S = 5.0  # per socket operation: a client that sends nothing is dropped after this


class BoundedHTTPServer(ThreadingHTTPServer):
    """ThreadingHTTPServer with a cap on concurrent connections."""

    daemon_threads = True

    def __init__(self, address, handler, max_connections: int = MAX_CONNECTIONS):
        super().__init__(address, handler)
        self._slots = threading.BoundedSemaphore(max_connections)
        self.refused = 0

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            self.refused += 1
            self.shutdown_request(request)  # over the cap: closed at once, never queued
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


def start_metrics_server(
    port: int,
    render: Callable[[], str],
    host: str = "127.0.0.1",
    max_connections: int = MAX_CONNECTIONS,
    timeout_s: float = TIMEOUT_S,
) -> BoundedHTTPServer:
    """Serve `render()` at /metrics (and /) on host:port; returns the running server."""

    class Handler(BaseHTTPRequestHandler):
        timeout = timeout_s  # StreamRequestHandler sets it on the connection's socket

        def do_GET(self) -> None:  # noqa: N802 - the http.server API
            if self.path.split("?")[0] not in ("/metrics", "/"):
                self.send_error(404, "only /metrics is served here")
                return
            try:
                body = render().encode()
            except Exception as exc:  # report, do not kill the scrape thread
                log.exception("metrics render failed")
                self.send_error(500, f"metrics failed: {exc.__class__.__name__}")
                return
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, fmt: str, *args) -> None:
            log.debug("metrics http: " + fmt, *args)

    server = BoundedHTTPServer((host, port), Handler, max_connections)
    threading.Thread(target=server.serve_forever, name="moed-metrics-http", daemon=True).start()
    log.info("metrics on http://%s:%d/metrics", host, server.server_address[1])
    return server
