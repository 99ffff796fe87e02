"""The ASGI application: routes of the three APIs and the ops endpoints, behind one guard that
checks the API key and the body size and counts every request.

Starlette rather than FastAPI: each API must answer bad input in its own error shape, which
FastAPI's automatic pydantic validation (a FastAPI-shaped 422) would have to be undone for; the
request models live in each API module as plain typed reads. Starlette is the ASGI toolkit
FastAPI itself is built on, with streaming responses that cancel on client disconnect.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable

from starlette.applications import Starlette
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from moed.client.async_client import AsyncClient

from . import anthropic_api, models_api, ollama_api, openai_api, ops, principal, responses_api
from .access_log import AccessLog
from .browser import BrowserGuard
from .config import GatewayConfig, is_loopback
from .context import Api, Gateway
from .deadline import AnswerDeadline
from .errors import ApiError, ErrorKind
from .limits import RequestLimits
from .metrics import GatewayMetrics
from .peer import LocalAuth, peer_uid
from .principal import matching_key


def api_of(path: str) -> Api:
    """Which API a path belongs to, for error shapes and metric labels."""
    if path.startswith("/v1/messages"):
        return Api.ANTHROPIC
    if path.startswith("/v1/"):
        return Api.OPENAI
    if path.startswith("/api/"):
        return Api.OLLAMA
    return Api.OPS


RENDERERS: dict[Api, Callable[[ApiError], Response]] = {
    Api.OPENAI: openai_api.error_response,
    Api.ANTHROPIC: anthropic_api.error_response,
    Api.OLLAMA: ollama_api.error_response,
    Api.OPS: ops.error_response,
}


def render_error(path: str, err: ApiError) -> Response:
    return RENDERERS[api_of(path)](err)


class BodyTooLarge(ApiError):
    def __init__(self, limit: int):
        super().__init__(ErrorKind.TOO_LARGE, f"the request body exceeds {limit} bytes")


class Guard:
    """Host and Origin, the local user or the API key, the body-size limit and per-request
    metrics, before any route runs."""

    OPEN_PATHS = frozenset({"/", "/health"})  # liveness probes need no key

    def __init__(self, app: ASGIApp, gateway: Gateway, known_paths: frozenset[str]):
        self.app = app
        self.gateway = gateway
        self.known_paths = known_paths
        config = gateway.config
        self.keys = tuple(k.encode() for k in config.api_keys)
        # Several keys: each is a principal of the prefix cache (principal.py).
        self.key_principals = len(self.keys) > 1
        self.browser = BrowserGuard(_served_hosts(config), config.cors_origins)
        # Without a key, a loopback client must be this user (another user cannot reach the
        # daemon's socket, and must not reach it through the gateway).
        self.check_uid = not self.keys and config.local_auth is LocalAuth.UID

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        api = api_of(path)
        started = time.perf_counter()
        status = 499  # no answer sent: the client left first (an app error still sends a 500)

        async def counted_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            refusal = self._refusal(scope)
            if refusal is not None:
                await render_error(path, refusal)(scope, receive, counted_send)
                return
            await self.app(scope, self._limited(receive), counted_send)
        finally:
            metrics = self.gateway.metrics
            # Label by route, never by whatever path a scanner sends (unbounded cardinality).
            endpoint = path if path in self.known_paths else "other"
            metrics.requests.labels(api.value, endpoint, str(status)).inc()
            metrics.latency.labels(api.value, endpoint).observe(time.perf_counter() - started)

    def _refusal(self, scope: Scope) -> ApiError | None:
        headers = dict(scope["headers"])
        refusal = self.browser.refusal(scope["method"], headers) or self._foreign_user(scope)
        if refusal is not None:
            return refusal
        preflight = scope["method"] == "OPTIONS" and bool(self.gateway.config.cors_origins)
        if self.keys and scope["path"] not in self.OPEN_PATHS and not preflight:
            given = headers.get(b"x-api-key") or _bearer(headers.get(b"authorization", b""))
            key = matching_key(given or b"", self.keys)
            if key is None:
                return ApiError(ErrorKind.AUTHENTICATION, "a valid API key is required")
            if self.key_principals:
                scope[principal.SCOPE_KEY] = principal.key_principal(key)
        elif self.gateway.config.principals_by_uid:
            scope[principal.SCOPE_KEY] = principal.peer_principal(scope)
        length = headers.get(b"content-length")
        limit = self.gateway.config.max_body_bytes
        if length is not None and (not length.isdigit() or int(length) > limit):
            return BodyTooLarge(limit)
        return None

    def _foreign_user(self, scope: Scope) -> ApiError | None:
        if not self.check_uid or scope["path"] in self.OPEN_PATHS:
            return None
        client, server = scope.get("client"), scope.get("server")
        uid = peer_uid(client, server) if client and server and is_loopback(client[0]) else None
        if uid == os.getuid():
            return None
        return ApiError(
            ErrorKind.FORBIDDEN,
            f"this gateway serves only its own user (uid {os.getuid()}); the connection is from "
            + (f"uid {uid}" if uid is not None else "a user it cannot tell"),
        )

    def _limited(self, receive: Receive) -> Receive:
        limit = self.gateway.config.max_body_bytes
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:  # a chunked body without Content-Length
                    raise BodyTooLarge(limit)
            return message

        return limited


def _served_hosts(config: GatewayConfig) -> tuple[str, ...]:
    """--allow-host names, and the address the gateway listens on when it is one (not 0.0.0.0)."""
    own = () if config.host in ("0.0.0.0", "::", "") else (config.host,)
    return (*config.allowed_hosts, *own)


def _bearer(value: bytes) -> bytes | None:
    scheme, _, token = value.partition(b" ")
    return token.strip() if scheme.lower() == b"bearer" else None


def build_app(config: GatewayConfig, client: AsyncClient | None = None) -> ASGIApp:
    gateway = Gateway(
        config,
        client or AsyncClient(config.socket, timeout=config.daemon_timeout_s, name="moed-gateway"),
        GatewayMetrics(),
    )
    routes = [
        *openai_api.ROUTES,
        *models_api.ROUTES,
        *responses_api.ROUTES,
        *anthropic_api.ROUTES,
        *ollama_api.ROUTES,
        *ops.ROUTES,
    ]

    async def on_api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return render_error(request.url.path, exc)

    async def on_not_found(request: Request, exc: Exception) -> Response:
        return render_error(
            request.url.path, ApiError(ErrorKind.NOT_FOUND, f"no route {request.url.path}")
        )

    async def on_method(request: Request, exc: Exception) -> Response:
        return render_error(
            request.url.path,
            ApiError(ErrorKind.INVALID_REQUEST, f"{request.method} is not allowed here"),
        )

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await gateway.client.close()

    app = Starlette(
        routes=routes,
        exception_handlers={ApiError: on_api_error, 404: on_not_found, 405: on_method},
        lifespan=lifespan,
    )
    app.state.gateway = gateway
    inner: ASGIApp = app
    if config.cors_origins:  # browsers send a preflight without the key: CORS answers it
        inner = CORSMiddleware(
            app,
            allow_origins=list(config.cors_origins),
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["*"],
        )
    inner = AnswerDeadline(inner, config.answer_timeout_s, render_error)
    inner = RequestLimits(
        inner, config.max_connections, config.max_requests_per_client, render_error
    )
    guarded: ASGIApp = Guard(inner, gateway, frozenset(route.path for route in routes))
    return AccessLog(guarded) if config.access_log else guarded
