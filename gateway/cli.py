"""`moed gateway`: serve the HTTP APIs on uvicorn, as a client of the daemon's socket."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import click

from moed.client.cli_common import global_options, log_level_option, log_to_stderr
from moed.client.errors import START_HINT
from moed.protocol.paths import nobody_listens

from .config import (
    DEFAULT_PORT,
    ConfigError,
    ConnectionLimits,
    GatewayConfig,
    build_config,
    gateway_key_path,
)
from .peer import LocalAuth

log = logging.getLogger("moed.gateway")


@click.command("gateway")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=DEFAULT_PORT, show_default=True, type=int, help="TCP port.")
@click.option(
    "--api-key-file",
    type=click.Path(path_type=Path, dir_okay=False),
    help="File holding the API key clients must send (required off loopback; mode 600).",
)
@click.option(
    "--max-connections",
    default=64,
    show_default=True,
    help="API requests in flight (then 429); /health and /metrics are never counted.",
)
@click.option(
    "--max-requests-per-client",
    default=48,
    show_default=True,
    help="API requests in flight from one client address (then 429).",
)
@click.option(
    "--max-open-connections",
    default=ConnectionLimits.max_open,
    show_default=True,
    help="Open sockets in all; at the cap the oldest idle one is closed for a new one.",
)
@click.option(
    "--max-open-per-client",
    default=ConnectionLimits.max_open_per_client,
    show_default=True,
    help="Open sockets from one client address.",
)
@click.option(
    "--header-timeout",
    default=ConnectionLimits.header_timeout_s,
    show_default=True,
    help="Seconds a connection may take to send a request's headers (then 408 and closed).",
)
@click.option(
    "--body-timeout",
    default=ConnectionLimits.body_idle_s,
    show_default=True,
    help="Seconds a request's body may pause between two pieces (then 408 and closed).",
)
@click.option(
    "--max-body-bytes", default=4 * 1024 * 1024, show_default=True, help="Largest request body."
)
@click.option(
    "--request-timeout",
    default=600.0,
    show_default=True,
    help="Seconds a non-streamed generation may take before it is cancelled.",
)
@click.option(
    "--answer-timeout",
    type=float,
    help="Seconds any request may wait for its answer to start (then 504) "
    "[default: --request-timeout + 5].",
)
@click.option(
    "--allow-host",
    "allowed_hosts",
    multiple=True,
    help="A Host name served besides localhost, 127.0.0.1 and [::1] (repeat; '*' for any).",
)
@click.option(
    "--local-auth",
    type=click.Choice([a.value for a in LocalAuth]),
    default=LocalAuth.AUTO.value,
    show_default=True,
    help="Without --api-key-file, who on this host is served: uid (the peer's user must be "
    "this one; Linux), key (a key written to gateway.key beside the socket, mode 600), off; "
    "auto: uid where the kernel lists socket owners, else key.",
)
@click.option("--quiet", is_flag=True, help="No access log line per request.")
@click.option(
    "--cors-origin",
    "cors_origins",
    multiple=True,
    help="A browser origin allowed to call the APIs (repeat; '*' for any), for web chat UIs.",
)
@log_level_option
def gateway(
    host: str,
    port: int,
    api_key_file: Path | None,
    max_connections: int,
    max_requests_per_client: int,
    max_open_connections: int,
    max_open_per_client: int,
    header_timeout: float,
    body_timeout: float,
    max_body_bytes: int,
    request_timeout: float,
    answer_timeout: float | None,
    allowed_hosts: tuple[str, ...],
    local_auth: str,
    quiet: bool,
    cors_origins: tuple[str, ...],
    log_level: str,
) -> None:
    """Serve OpenAI-, Ollama- and Anthropic-compatible HTTP APIs backed by the daemon
    (a client of its --socket; without --api-key-file, loopback and this user only)."""
    import uvicorn

    from .app import build_app
    from .connections import ConnectionTable, guarded_protocol

    log_to_stderr(log_level)
    try:
        config = build_config(
            global_options().socket_path,
            host,
            port,
            api_key_file,
            LocalAuth(local_auth),
            max_connections=max_connections,
            max_requests_per_client=max_requests_per_client,
            connections=ConnectionLimits(
                max_open=max_open_connections,
                max_open_per_client=max_open_per_client,
                header_timeout_s=header_timeout,
                body_idle_s=body_timeout,
            ),
            max_body_bytes=max_body_bytes,
            request_timeout_s=request_timeout,
            answer_timeout_s=answer_timeout if answer_timeout else request_timeout + 5,
            cors_origins=tuple(cors_origins),
            allowed_hosts=tuple(allowed_hosts),
            access_log=not quiet,
        )
    except ConfigError as exc:
        click.echo(f"moed gateway: {exc}", err=True)
        sys.exit(2)
    log.info(
        "gateway for %s on http://%s:%d (%s)",
        config.socket,
        host,
        port,
        _who_is_served(config, api_key_file),
    )
    if nobody_listens(config.socket):  # it may start later: the gateway serves it then
        log.warning(
            "no daemon is running on %s: every API answers 503 (no_daemon) until one starts; %s",
            config.socket,
            START_HINT,
        )
    uvicorn.run(
        build_app(config),
        host=config.host,
        port=config.port,
        # Connection caps and the header deadline live in the protocol (connections.py); the
        # request limits in the app, where /health is never counted.
        http=guarded_protocol(ConnectionTable(config.connections)),
        ws="none",  # no WebSocket routes; an upgrade would leave the connection table
        timeout_keep_alive=int(config.keep_alive_s),
        timeout_graceful_shutdown=10,
        log_level=log_level.lower(),
        access_log=False,
        lifespan="on",
    )


def _who_is_served(config: GatewayConfig, api_key_file: Path | None) -> str:
    if api_key_file is not None:
        keys = len(config.api_keys)
        if keys > 1:  # each a principal of the prefix cache
            return f"{keys} api keys from {api_key_file}, each a principal"
        return f"api key from {api_key_file}"
    if config.api_keys:
        return f"api key written to {gateway_key_path(config.socket)}"
    if config.local_auth is LocalAuth.UID:
        return f"loopback, uid {os.getuid()} only"
    return "loopback, any local user"
