"""Daemon lifecycle: resolve the model, plan the start, compose the engine and the transport, bind,
serve, drain. Returns the process exit code."""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
from dataclasses import replace
from pathlib import Path

import zmq

from moed.daemon import __version__
from moed.daemon.config import Config, ModelEntry, ServeConfig
from moed.daemon.distributed.hostfile import HostfileError
from moed.daemon.distributed.rank0 import check_supported, start_group
from moed.daemon.distributed.rank_model import PipelineUnsupported, num_layers
from moed.daemon.distributed.spec import group_spec
from moed.daemon.distributed.split import SplitError, parse_split
from moed.daemon.engine.loop import Engine
from moed.daemon.engine.status import EngineStatus
from moed.daemon.ground.exit_codes import DaemonExit, for_supervisor
from moed.daemon.ground.run_log import (
    DAEMON_LOG,
    RotatingLog,
    previous_run_end,
    read_start_records,
    record_start,
)
from moed.daemon.model.cache_folder import UnsafeCacheFolder, check_cache_folder
from moed.daemon.model.servable import Servable
from moed.daemon.model.source import ModelNotFound, ModelUnreadable, resolve_model
from moed.daemon.runtime.load_progress import show_load_progress
from moed.daemon.runtime.start_plan import plan_start
from moed.daemon.service.launchctl import previous_exit as previous_exit_from_launchd
from moed.daemon.telemetry.http import start_metrics_server
from moed.daemon.transport.model_set import model_settings
from moed.daemon.transport.pipes import ZmqEventSink
from moed.daemon.transport.server import AlreadyRunning, Server
from moed.protocol.paths import UnsafeSocketPath

log = logging.getLogger("moed")


def run_daemon(config: Config) -> int:
    serve = started_settings(config)
    # A SIGABRT or SIGSEGV (MLX on a Metal OOM, a C++ abort in a backend thread) leaves every
    # thread's Python stack in stderr (the service's log) before the process dies as it would.
    faulthandler.enable(all_threads=True)
    try:
        alias = next((e for e in config.models if e.name == serve.model), None)
        model_path = resolve_model(alias.model if alias is not None else serve.model)
    except ModelNotFound as exc:
        print(f"moed: {exc}", file=sys.stderr)
        return DaemonExit.MODEL_NOT_FOUND
    except ModelUnreadable as exc:  # fix the file: a restart cannot help
        print(f"moed: model: {exc}", file=sys.stderr)
        return DaemonExit.MODEL_UNUSABLE
    if serve.pipelined and (why := _check_pipeline(serve, model_path)):
        print(f"moed: pipeline: {why}", file=sys.stderr)
        return DaemonExit.CONFIG
    if why := _unsafe_prefix_cache_folder(serve):  # before anything is loaded
        print(f"moed: {why}", file=sys.stderr)
        return DaemonExit.CONFIG
    try:
        server = _compose(serve, model_path, config.models, config.serve)
    except ValueError as exc:  # e.g. a malformed debug_faults or cache budget setting
        print(f"moed: configuration: {exc}", file=sys.stderr)
        return DaemonExit.CONFIG
    if serve.metrics_port:
        try:
            start_metrics_server(serve.metrics_port, server.telemetry.metrics_text)
        except OSError as exc:  # port taken: refuse to start rather than run without metrics
            print(f"moed: metrics port {serve.metrics_port}: {exc}", file=sys.stderr)
            return DaemonExit.CONFIG  # before bind: no socket left behind
    try:
        server.bind()
    except AlreadyRunning as exc:
        print(f"moed: {exc}", file=sys.stderr)
        return DaemonExit.ALREADY_RUNNING
    except UnsafeSocketPath as exc:  # another user's directory, a symlink, group-writable
        print(f"moed: {exc}", file=sys.stderr)
        return DaemonExit.CONFIG
    except (
        OSError,
        zmq.ZMQError,
    ) as exc:  # the socket directory cannot be made private, or bind failed
        print(f"moed: socket {serve.socket}: {exc}", file=sys.stderr)
        return DaemonExit.CONFIG
    group = None
    if server.serve.pipelined:
        group = start_group(server.serve, model_path)
        group.on_failure = lambda reason: setattr(server, "group_failure", reason)
    server.install_signal_handlers()
    # The transport thread answers control messages while the engine thread runs Python between MLX
    # evaluations; a 1 ms GIL switch interval (default 5 ms) bounds how long a `cancel` or `ping`
    # waits.
    sys.setswitchinterval(0.001)
    try:
        run_log = _open_run_log(server, model_path)
    except OSError as exc:  # the log is advisory: a symlink or a read-only dir never stops serving
        log.warning("daemon.log in %s cannot be opened (%s); stderr only", serve.log_dir, exc)
        run_log = None
    log.info(
        "moed %s serving %s on %s (boot %s)",
        server.status.get("version"),
        model_path,
        serve.socket,
        server.boot_id,
    )
    show_load_progress(server.status)  # a bar when stderr is a terminal
    code = server.run()
    _hold_exit_code()
    log.info("moed exiting with code %d", code)
    if group is not None:
        group.stop()
    if run_log is not None:
        run_log.record_exit(
            code, DaemonExit(code).name.lower() if code in DaemonExit._value2member_map_ else None
        )
        run_log.close()
    if server.group_failure is not None:
        # The engine thread may still sit in a collective with the lost rank: do not wait for it.
        logging.shutdown()
        os._exit(for_supervisor(code))
    return code


def _unsafe_prefix_cache_folder(serve: ServeConfig) -> str | None:
    """Why the SSD tier's folder is refused (others can write it: cache_folder.py), or None."""
    try:
        folder = serve.prefix_cache_ssd_folder
        if folder is not None:
            check_cache_folder(folder)
    except UnsafeCacheFolder as exc:
        return str(exc)
    except ValueError:  # a malformed size: the plan below says so
        pass
    return None


def _compose(
    serve: ServeConfig, model_path: Path, models: tuple[ModelEntry, ...], others: ServeConfig
) -> Server:
    """The process: this start's plan, the engine that serves it, the transport in front; the
    other models' engines are made on request (transport/model_set.py), each started lazily."""
    plan = plan_start(serve, model_path, models, others)
    status = EngineStatus()
    # Each engine thread's end of the event pipe (ZMQ sockets are per thread; one context).
    sink = lambda: ZmqEventSink(zmq.Context.instance())  # noqa: E731

    def new_engine(settings: ServeConfig, servable: Servable, status: EngineStatus) -> Engine:
        return Engine(settings, servable.path, sink, status, lazy=True)

    engine = Engine(plan.serve, model_path, sink, status)
    return Server(plan, engine, status, new_engine=new_engine)


def started_settings(config: Config) -> ServeConfig:
    """`--model` may name a `[models]` alias: its path and settings are the started model's."""
    entry = next((e for e in config.models if e.name == config.serve.model), None)
    if entry is None:
        return config.serve
    servable = Servable(entry.name, Path(entry.model), entry)
    settings = model_settings(config.serve, servable, own_folder=False)  # the folder itself
    return replace(settings, model=entry.name)  # the name clients use; the path resolved below


def _hold_exit_code() -> None:
    """The exit code is decided (5 after a watchdog's shutdown, recorded in crash.json): from here
    on a SIGTERM must not replace it. Python restores SIGTERM's default action early in its
    finalization, and the teardown after it (the model's arrays, the ZMQ context) can take a second;
    a SIGTERM then, such as the watchdog's next step while swap still grows, killed the process and
    the supervisor saw -15 instead. Ignoring SIGTERM survives finalization (Python only resets
    handlers it installed itself); SIGKILL still ends a teardown that hangs."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _check_pipeline(serve, model_path) -> str | None:
    """Why a configured pipeline cannot start (before anything binds or spawns), else None."""
    try:
        check_supported(model_path)
        group = group_spec(serve)
        if group.given_split is None:
            parse_split(serve.pipeline_split, group.size, num_layers(model_path))
        else:
            parse_split(",".join(map(str, group.given_split)), group.size, num_layers(model_path))
    except (PipelineUnsupported, HostfileError, SplitError, OSError) as exc:
        return str(exc)
    return None


def _open_run_log(server: Server, model_path) -> RotatingLog:
    """The rotating daemon.log: a start record (version, model, budget, why the last run ended),
    then logging."""
    log_path = Path(server.serve.log_dir) / DAEMON_LOG
    starts = read_start_records(log_path)
    previous_pid = starts[-1].get("pid") if starts else None
    plan = server.start_plan
    last = plan.last_crash
    # A crash record speaks of the previous run only if that run crashed: an older crash (still
    # within the restart window) is not why the last run ended.
    if not (plan.unclean_previous or (last and str(last.get("pid")) == previous_pid)):
        last = None
    reasons = [
        f"{last['kind']}: {str(last.get('message', ''))[:200]}" if last else None,
        previous_exit_from_launchd(),
        previous_run_end(log_path),  # the log's own word: the last run's exit record
    ]
    previous = "; ".join(r for r in reasons if r) or None
    run_log = record_start(
        server.serve.log_dir, __version__, str(model_path), server.serve.cache_budget, previous
    )
    run_log.adopt_logging()
    return run_log
