"""One access-log line per request, as uvicorn's own (client, method, path, HTTP version, status)
plus the duration and a request id that the response carries as `X-Request-Id`. The query string
and the body are never logged: a prompt is the user's, not the log's."""

from __future__ import annotations

import json
import logging
import time
import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("moed.gateway.access")
REQUEST_ID_HEADER = b"x-request-id"


class AccessLog:
    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = uuid.uuid4().hex[:16]
        scope.setdefault("state", {})["request_id"] = request_id
        started = time.perf_counter()
        status = 0  # none sent: the client left before an answer, or the app failed

        async def stamped_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = [*message.get("headers", ()), (REQUEST_ID_HEADER, request_id.encode())]
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, stamped_send)
        finally:
            client = scope.get("client")
            log.info(
                '%s - "%s %s HTTP/%s" %s %.1fms id=%s',
                f"{client[0]}:{client[1]}" if client else "-",
                scope["method"],
                json.dumps(scope["path"])[1:-1],  # a %0A in the path must not forge a line
                scope.get("http_version", "1.1"),
                status or "-",
                (time.perf_counter() - started) * 1000,
                request_id,
            )
