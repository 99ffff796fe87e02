"""Requests in flight: at most `max_requests` API requests at once and `max_requests_per_client`
from one client address, answered 429 (in the API's shape, with Retry-After) beyond. The last
sixteenth of `max_requests` (at least one) is kept for addresses with nothing in flight, so a few
busy clients can never fill the gateway: another client always gets a slot. The ops paths
(/health, /metrics, /) are never counted, so a gateway full of generations still says how it
is."""

from __future__ import annotations

import collections
from collections.abc import Callable

from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import ApiError, ErrorKind

OPS_PATHS = frozenset({"/", "/health", "/metrics"})


class RequestLimits:
    def __init__(
        self,
        app: ASGIApp,
        max_requests: int,
        max_per_client: int,
        render: Callable[[str, ApiError], Response],
    ):
        self.app = app
        self.max_requests = max_requests
        self.max_per_client = max_per_client
        self.render = render
        self.total = 0
        self.per_client: collections.Counter[str] = collections.Counter()
        self.reserved = max(1, max_requests // 16)  # for clients with nothing in flight

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPS_PATHS:
            await self.app(scope, receive, send)
            return
        client = client_address(scope)
        refusal = self._refusal(client)
        if refusal is not None:
            await self.render(scope["path"], refusal)(scope, receive, send)
            return
        self.total += 1
        self.per_client[client] += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.total -= 1
            self.per_client[client] -= 1
            if not self.per_client[client]:
                del self.per_client[client]

    def _refusal(self, client: str) -> ApiError | None:
        if self.total >= self.max_requests:
            return ApiError(
                ErrorKind.OVERLOADED, f"the gateway has {self.total} requests in flight; retry"
            )
        if self.per_client[client] >= self.max_per_client:
            return ApiError(
                ErrorKind.OVERLOADED,
                f"this client has {self.per_client[client]} requests in flight; retry",
            )
        if self.per_client[client] and self.total >= self.max_requests - self.reserved:
            return ApiError(
                ErrorKind.OVERLOADED,
                f"this client has {self.per_client[client]} requests in flight and the gateway's "
                f"last {self.reserved} are kept for clients with none; retry",
            )
        return None


def client_address(scope: Scope) -> str:
    """The address a request came from: whom the limits count it against, and the `caller` the
    daemon gives rows in turn to."""
    return str((scope.get("client") or ("?", 0))[0])
