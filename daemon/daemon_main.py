"""Daemon lifecycle: resolve the model, bind, serve, drain. Returns the process exit code."""

from __future__ import annotations

import logging
import sys

from .config import Config
from .exit_codes import DaemonExit
from .model_source import ModelNotFound, resolve_model
from .server import AlreadyRunning, Server

log = logging.getLogger("moed")


def run_daemon(config: Config) -> int:
    serve = config.serve
    try:
        model_path = resolve_model(serve.model)
    except ModelNotFound as exc:
        print(f"moed: {exc}", file=sys.stderr)
        return DaemonExit.MODEL_NOT_FOUND
    try:
        server = Server(serve, model_path)
    except ValueError as exc:  # e.g. a malformed debug_faults or cache budget setting
        print(f"moed: configuration: {exc}", file=sys.stderr)
        return DaemonExit.CONFIG
    try:
        server.bind()
    except AlreadyRunning as exc:
        print(f"moed: {exc}", file=sys.stderr)
        return DaemonExit.ALREADY_RUNNING
    except ValueError as exc:  # socket path too long
        print(f"moed: {exc}", file=sys.stderr)
        return DaemonExit.CONFIG
    if serve.metrics_port:
        from .telemetry.http import start_metrics_server

        try:
            start_metrics_server(serve.metrics_port, server.telemetry.metrics_text)
        except OSError as exc:  # port taken: refuse to start rather than run without metrics
            print(f"moed: metrics port {serve.metrics_port}: {exc}", file=sys.stderr)
            return DaemonExit.CONFIG
    server.install_signal_handlers()
    log.info("moed %s serving %s on %s (boot %s)", server.status.get("version"), model_path, serve.socket, server.boot_id)
    code = server.run()
    log.info("moed exiting with code %d", code)
    return code
