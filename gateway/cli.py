"""`moed gateway`: serve the HTTP APIs on uvicorn, as a client of the daemon's socket."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import click

from moed.client.cli_common import global_options, log_level_option, log_to_stderr

from .config import DEFAULT_PORT, ConfigError, build_config

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
    "--max-connections", default=64, show_default=True, help="Concurrent connections (then 503)."
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
    max_body_bytes: int,
    request_timeout: float,
    cors_origins: tuple[str, ...],
    log_level: str,
) -> None:
    """Serve OpenAI-, Ollama- and Anthropic-compatible HTTP APIs backed by the daemon
    (a client of its --socket; loopback only unless --api-key-file is given)."""
    import uvicorn

    from .app import build_app

    log_to_stderr(log_level)
    try:
        config = build_config(
            global_options().socket_path,
            host,
            port,
            api_key_file,
            max_connections=max_connections,
            max_body_bytes=max_body_bytes,
            request_timeout_s=request_timeout,
            cors_origins=tuple(cors_origins),
        )
    except ConfigError as exc:
        click.echo(f"moed gateway: {exc}", err=True)
        sys.exit(2)
    log.info(
        "gateway for %s on http://%s:%d (api key %s)",
        config.socket,
        host,
        port,
        "required" if config.api_key else "off: loopback only",
    )
    uvicorn.run(
        build_app(config),
        host=config.host,
        port=config.port,
        limit_concurrency=config.max_connections,
        timeout_keep_alive=int(config.keep_alive_s),
        timeout_graceful_shutdown=10,
        log_level=log_level.lower(),
        access_log=False,
        lifespan="on",
    )
