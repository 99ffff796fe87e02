"""`moed serve --metrics-port P`: the Prometheus text on http://127.0.0.1:P/metrics for a scraper.

Loopback only (the socket's owner-only rule has no HTTP twin; keep it off the network), served by
a daemon thread so it never holds the daemon up at exit.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from moed.daemon.telemetry.metrics import CONTENT_TYPE

log = logging.getLogger("moed.telemetry")


def start_metrics_server(
    port: int, render: Callable[[], str], host: str = "127.0.0.1"
) -> ThreadingHTTPServer:
    """Serve `render()` at /metrics (and /) on host:port; returns the running server."""

    class Handler(BaseHTTPRequestHandler):
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

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="moed-metrics-http", daemon=True).start()
    log.info("metrics on http://%s:%d/metrics", host, server.server_address[1])
    return server
