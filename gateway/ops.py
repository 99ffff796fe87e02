"""GET /health (ready, loading, recovering, stalled, restarting, no_daemon; JSON) and GET /metrics
(Prometheus text: the daemon's counters, then the gateway's own)."""

from __future__ import annotations

import asyncio
import enum
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from moed.client import ClientError, DaemonNotRunning
from moed.client.errors import START_HINT

from .context import Gateway
from .errors import ApiError

HEALTH_TIMEOUT_S = 2.0
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Health(str, enum.Enum):
    READY = "ready"
    LOADING = "loading"  # the daemon is up and loading its model
    # A device failure inside a step is being recovered in place (the model stays loaded):
    # requests wait, none fails; ready again in moments.
    RECOVERING = "recovering"
    STALLED = "stalled"  # busy, but no token or prompt chunk for stall_after_s
    RESTARTING = "restarting"  # unreachable, draining or failed: the service manager restarts it
    NO_DAEMON = "no_daemon"  # nothing listens on the socket: none started, or it died


def error_response(err: ApiError) -> Response:
    return JSONResponse({"error": err.message}, status_code=err.status, headers=err.headers())


def judge(status: dict, stall_after_s: float, now: float) -> Health:
    state = status.get("state")
    if state == "loading":
        return Health.LOADING
    if state == "idle":  # the keep-alive released the model; the next request reloads it
        return Health.READY
    if state == "stalled":  # the daemon's own progress deadline passed
        return Health.STALLED
    if state == "recovering":
        return Health.RECOVERING
    if state != "ready":  # failed (the engine is dead: never 200 from here on), draining
        return Health.RESTARTING
    if status.get("busy"):
        marks = [m for m in (status.get("last_token_at"), status.get("last_progress_at")) if m]
        if marks and now - max(marks) > stall_after_s:
            return Health.STALLED
    return Health.READY


async def health(request: Request) -> Response:
    gateway: Gateway = request.app.state.gateway
    try:
        # A probe answers fast: a daemon that cannot say its status in time is not healthy.
        status = await asyncio.wait_for(gateway.client.status(), HEALTH_TIMEOUT_S)
    except DaemonNotRunning as exc:
        body: dict[str, Any] = {
            "status": Health.NO_DAEMON.value,
            "daemon": None,
            "error": f"{exc}; {START_HINT}",
        }
        return JSONResponse(body, status_code=503, headers={"Retry-After": "5"})
    except (ClientError, TimeoutError) as exc:
        reason = str(exc) or "no answer in time"
        body = {"status": Health.RESTARTING.value, "daemon": None, "error": reason}
        return JSONResponse(body, status_code=503, headers={"Retry-After": "5"})
    verdict = judge(status, gateway.config.stall_after_s, time.time())
    body = {
        "status": verdict.value,
        "daemon": {
            "state": status.get("state"),
            "pid": status.get("pid"),
            "boot_id": status.get("boot_id"),
            "uptime_s": status.get("uptime_s"),
            "model": (status.get("model") or {}).get("name"),
            "active_requests": status.get("active_requests"),
            "queued_requests": status.get("queued_requests"),
            "last_token_at": status.get("last_token_at"),
            "recoveries": status.get("recoveries"),
            "last_recovery": status.get("last_recovery"),
        },
    }
    if verdict is Health.READY:
        return JSONResponse(body)
    return JSONResponse(body, status_code=503, headers={"Retry-After": "5"})


async def metrics(request: Request) -> Response:
    gateway: Gateway = request.app.state.gateway
    try:
        daemon_text = (await gateway.client.metrics()).get("text") or ""
    except ClientError:
        daemon_text = ""  # the gateway's own metrics still say what it saw
    up = (
        "# HELP moed_gateway_daemon_up Whether the daemon answered this scrape\n"
        "# TYPE moed_gateway_daemon_up gauge\n"
        f"moed_gateway_daemon_up {1 if daemon_text else 0}\n"
    )
    return PlainTextResponse(
        daemon_text + up + gateway.metrics.render(), media_type=METRICS_CONTENT_TYPE
    )


async def root(request: Request) -> Response:
    # Tools that speak to ollama probe `GET /` for this line before anything else.
    return PlainTextResponse("moed gateway is running")


ROUTES = [
    Route("/", root, methods=["GET", "HEAD"]),
    Route("/health", health, methods=["GET"]),
    Route("/metrics", metrics, methods=["GET"]),
]
