"""The daemon's transport: a ZMQ ROUTER on the main thread, frames in, queue to the engine,
events out.

Control messages (status, cancel, shed, shutdown, ping) are answered here and never wait behind a
generation. Startup → main loop → drain; signal handlers only set flags.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import psutil
import zmq

from moed.daemon import __version__
from moed.daemon.config import ServeConfig
from moed.daemon.engine.loop import Engine
from moed.daemon.engine.request import RequestKey
from moed.daemon.engine.status import DaemonState, EngineStatus
from moed.daemon.ground import crashlog
from moed.daemon.ground.exit_codes import DaemonExit
from moed.daemon.ground.live_probe import probe_live_daemon
from moed.daemon.model.limits import read_limits
from moed.daemon.model.servable import Catalog, Servable
from moed.daemon.telemetry import LiveTelemetry
from moed.daemon.transport.admission import DuplicateId
from moed.daemon.transport.bodies import status_body
from moed.daemon.transport.connections import ConnectionCount, connection_limit
from moed.daemon.transport.control import ControlToken
from moed.daemon.transport.dispatch import dispatch_control
from moed.daemon.transport.generate_admission import GenerateAdmission
from moed.daemon.transport.group_failure import GroupFailure
from moed.daemon.transport.model_set import EngineFactory, ModelSet
from moed.daemon.transport.outbound import Outbound
from moed.daemon.transport.pipes import (
    EVENTS_ENDPOINT,
    TERMINAL_FLAG,
    TOKEN_FLAG,
    unpack_event,
)
from moed.daemon.transport.plan import ServerPlan
from moed.daemon.transport.stream_failures import StreamFailures
from moed.daemon.transport.streams import StreamTable
from moed.protocol import (
    MAX_FRAME_BYTES,
    ErrorCode,
    ProtocolError,
    decode,
    encode,
    validate_generate,
    validate_request,
)
from moed.protocol import messages as wire
from moed.protocol.codec import peek_id
from moed.protocol.paths import endpoint_for, ensure_private_dir
from moed.protocol.validation import is_generate

# Inbound frames taken per loop turn before the engine's events are forwarded: a client flooding
# requests cannot starve other clients' streams.
RECEIVE_BATCH = 64
# Plain ints: pyzmq turns enum arguments into their values on every call (once per token here).
_POLLIN, _EVENTS, _NOBLOCK = int(zmq.POLLIN), int(zmq.EVENTS), int(zmq.NOBLOCK)

log = logging.getLogger("moed.server")


class AlreadyRunning(RuntimeError):
    pass


@dataclass
class Server:
    """Serves one start's final plan (runtime/start_plan.py) with an engine built for it."""

    plan: ServerPlan
    engine: Engine
    status: EngineStatus
    boot_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    extra_welcome: dict[str, Any] = field(default_factory=dict)
    new_engine: EngineFactory | None = None  # an engine for another model (runtime/main.py)

    def __post_init__(self) -> None:
        self.serve, self.model_path = self.plan.serve, self.plan.model_path
        self.start_plan, self.budget_backoff = self.plan.crashes, self.plan.budget_backoff
        self.context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.endpoint = endpoint_for(self.serve.socket)
        self.limits = read_limits(self.serve, self.model_path)
        self._streams = StreamTable()  # admitted generations not yet terminal
        self.control_token = ControlToken(self.serve.socket)
        catalog = Catalog(self.serve.model, self.model_path, self.plan.models)
        self.models = ModelSet(catalog, self.plan, self.engine, self.status, self._new_engine)
        self.admission = GenerateAdmission(
            self.serve, self.boot_id, self.start_plan.poison, self._streams, self.models
        )
        self.failures = StreamFailures(self.serve, self._streams, self.models, self._engine_of)
        self._draining = False
        self._restart_reason: str | None = None
        self._drain_deadline = 0.0
        self._stop_requested = threading.Event()
        # Set by a pipeline group's monitor thread (a GroupFailure): another rank died or stalled.
        self.group_failure: GroupFailure | None = None
        self.engine.on_crash = self._record_crash
        self._process = psutil.Process()
        self.telemetry = LiveTelemetry(
            self.status_body,
            lambda: self.engine.loaded and self.engine.loaded.streamer,
            lambda: self.status.get("tokens_generated"),
            self.models.figures,
        )

    # ---- startup ---------------------------------------------------------------------------
    def bind(self) -> None:
        ensure_private_dir(self.serve.socket.parent)
        if self.serve.socket.exists():
            answer = probe_live_daemon(self.endpoint, self.context)
            if answer is not None:
                raise AlreadyRunning(
                    f"a live daemon (boot {answer.get('boot_id', '?')}, "
                    f"pid {answer.get('pid', '?')}) "
                    f"already serves {self.serve.socket}; stop it with `moe stop`"
                )
            log.info("removing stale socket %s", self.serve.socket)
            self.serve.socket.unlink(missing_ok=True)
        self.events = self.context.socket(zmq.PULL)
        self.events.bind(EVENTS_ENDPOINT)
        self.router = self.context.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sending to a vanished client raises
        self.router.setsockopt(zmq.LINGER, 0)
        # Bounded per connection: a client that does not read is cut off (outbound.py's policy).
        self.router.setsockopt(zmq.SNDHWM, self.serve.client_send_hwm)
        self.router.bind(self.endpoint)
        self.connections = ConnectionCount(
            self.router, connection_limit(self.serve.max_connections)
        )
        os.chmod(self.serve.socket, 0o600)
        self.control_token.write()
        self.outbound = Outbound(self.router, self.failures.client_slow, self.failures.client_gone)
        self.status.update(
            pid=os.getpid(),
            boot_id=self.boot_id,
            socket=str(self.serve.socket),
            version=__version__,
        )

    def _record_crash(self, kind: crashlog.CrashKind, message: str) -> None:
        extra = {"budget_backoff": self.budget_backoff} if self.budget_backoff else None
        entry = crashlog.record_crash(self.serve.state_dir, kind, message, self.boot_id, extra)
        log.error(
            "crash recorded in %s: %s: %s",
            crashlog.crash_path(self.serve.state_dir),
            kind.value,
            message,
        )
        self.status.update(crashing=entry)

    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGTERM, lambda *_: self.request_stop("SIGTERM"))
        signal.signal(signal.SIGINT, lambda *_: self.request_stop("SIGINT"))

    def request_stop(self, reason: str) -> None:
        log.info("stop requested: %s", reason)
        self._stop_requested.set()

    # ---- main loop -------------------------------------------------------------------------
    def run(self) -> int:
        """Serve until asked to stop; returns the process exit code."""
        if self.start_plan.refuse:
            # Exit 0: launchd (SuccessfulExit=false) and systemd (on-failure) leave a clean exit
            # down.
            log.error("restart budget spent: %s", self.start_plan.refuse)
            self._close()
            return DaemonExit.OK
        if self.start_plan.unclean_previous:
            log.warning(
                "the previous run (boot %s) died without a clean exit",
                self.start_plan.unclean_previous.get("boot_id"),
            )
        crashlog.begin_run(self.serve.state_dir, self.boot_id, budget=self.budget_backoff)
        self.engine.start()  # the started model loads now; the others on request
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self.events, zmq.POLLIN)
        poller.register(self.connections.monitor, zmq.POLLIN)
        try:
            while True:
                if self._stop_requested.is_set() and not self._draining:
                    self._begin_drain()
                if self._draining and (
                    not self._streams or time.monotonic() > self._drain_deadline
                ):
                    break
                if self.group_failure is not None:  # first: the engine's error follows from it
                    return self._group_failed(poller, self.group_failure)
                if (code := self._engines_failed(poller)) is not None:
                    return code
                for sock, _ in poller.poll(50):
                    if sock is self.router:
                        self._receive_some(RECEIVE_BATCH)
                    elif sock is self.connections.monitor:
                        self.connections.drain()
                    else:
                        self._forward_events()
                self.outbound.retry_owed()
                self.failures.check_progress(self.outbound.send)
            engines = [m.engine for m in self.models.models()]
            for engine in engines:  # what is still in flight ends with `shutting_down`
                engine.stop()
            for engine in engines:
                engine.thread.join(timeout=5.0)
            self._flush_events(poller)
            if any(engine.thread.is_alive() for engine in engines):
                # A wedged engine: exit non-zero so that the service manager starts a fresh one.
                self._record_crash(
                    crashlog.CrashKind.ENGINE_FAILED, "the engine was still stuck after the drain"
                )
                return DaemonExit.FAILED
            if self._restart_reason:
                self._record_crash(crashlog.CrashKind.MEMORY_PRESSURE, self._restart_reason)
                return DaemonExit.OUT_OF_MEMORY
            crashlog.end_run(self.serve.state_dir, self.boot_id)
            return DaemonExit.OK
        finally:
            self._close()

    def _group_failed(self, poller: zmq.Poller, failure: GroupFailure) -> int:
        """A pipeline rank is gone: the engine may be stuck in a collective, so the transport
        itself ends every request in flight with a retryable error, then the group restarts."""
        self._flush_events(poller)  # tokens already produced go out first
        message = f"pipeline {failure.reason}; the daemon restarts the group"
        self.status.update(state=DaemonState.FAILED, error=message)
        self._record_crash(crashlog.CrashKind.RANK_FAILED, message)
        self.failures.fail_all(self.outbound.send, ErrorCode.RANK_FAILED, message)
        return failure.exit_code

    def _begin_drain(self) -> None:
        self._draining = True
        self._drain_deadline = time.monotonic() + self.serve.drain_timeout_s
        self.status.update(state=DaemonState.DRAINING)
        log.info(
            "draining %d request(s), deadline %.1fs", len(self._streams), self.serve.drain_timeout_s
        )

    def _flush_events(self, poller: zmq.Poller) -> None:
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline and poller.poll(20):
            self._forward_events()

    def _close(self) -> None:
        self.telemetry.close()
        self.control_token.remove()
        self.connections.close()
        self.router.close(linger=0)
        self.events.close(linger=0)
        try:
            self.serve.socket.unlink()
        except FileNotFoundError:
            pass

    # ---- inbound -----------------------------------------------------------------------------
    def _receive_some(self, limit: int) -> None:
        for _ in range(limit):
            try:
                frames = self.router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._handle_frames(frames)

    def _handle_frames(self, frames: list[bytes]) -> None:
        identity, body = frames[0], frames[1:]
        envelope: list[bytes] = []
        if len(body) == 2 and body[0] == b"":  # a REQ socket's empty delimiter
            envelope, body = [b""], body[1:]
        if len(body) != 1:
            return  # not one message per frame: nothing to answer to
        request_id = None
        try:
            msg = decode(body[0], MAX_FRAME_BYTES)
            request_id = msg.get("id") if isinstance(msg, dict) else None
            if is_generate(msg):  # checked in full, and typed once, by the protocol's validation
                name = msg.get("model")  # its model's limits check it (a bad type: validation's)
                model = self.models.route(name if isinstance(name, str) else None)
                request = validate_generate(msg, model.limits)
                self.admission.admit(identity, msg, request, model, self._draining)
                reply = None  # admitted: its stream answers
            else:
                kind, request_id = validate_request(msg, self.limits)
                reply = dispatch_control(self, identity, kind, msg)
        except DuplicateId as exc:
            reply = {**wire.error(None, exc.code, exc.message), "target": exc.target}
        except ProtocolError as exc:
            if request_id is None:  # refused before decoding: name the request all the same
                request_id = peek_id(body[0])
            reply = wire.refusal(request_id if isinstance(request_id, (str, int)) else None, exc)
        except Exception as exc:  # a bug in one request must not take the daemon down
            log.exception("request handling failed")
            reply = wire.error(
                request_id if isinstance(request_id, (str, int)) else None,
                ErrorCode.INTERNAL,
                str(exc),
            )
        if reply is not None:
            self.outbound.send(identity, envelope, encode(reply))

    # ---- outbound ----------------------------------------------------------------------------
    def _forward_events(self) -> None:
        ended = False
        events = self.events
        option = cast(Callable[[int], int], events.get)  # typed int | bytes; EVENTS is an int
        # Asking the socket is cheaper than the zmq.Again exception a blocking-free recv raises.
        while option(_EVENTS) & _POLLIN:
            flag, identity, id_bytes, frame = unpack_event(events.recv(_NOBLOCK))
            terminal = flag == TERMINAL_FLAG
            key = (identity, decode(id_bytes))
            out = self._streams.outgoing(key, frame, flag == TOKEN_FLAG, terminal)
            ended = ended or terminal
            if terminal:
                self.models.ended(key)
            if out is not None:
                self.outbound.send(identity, [], out)
        if ended:
            crashlog.write_inflight(
                self.serve.state_dir, self.boot_id, self._streams.fingerprints()
            )

    # ---- models ------------------------------------------------------------------------------
    def _new_engine(self, serve: ServeConfig, servable: Servable, status: EngineStatus) -> Engine:
        if self.new_engine is None:
            raise ProtocolError(ErrorCode.MODEL_NOT_FOUND, "this daemon serves one model only")
        return self.new_engine(serve, servable, status)

    def _engine_of(self, key: RequestKey) -> Engine:
        model = self.models.of_stream(key)
        return model.engine if model is not None else self.engine

    def _engines_failed(self, poller: zmq.Poller) -> int | None:
        """A failed engine's own streams have ended with its error. The process exits (the
        service manager restarts it, smaller) only when no other model is loaded; else the
        failed model alone is dropped and the others keep serving."""
        failed = self.models.failed()
        if not failed:
            return None
        self._flush_events(poller)
        others = [m for m in self.models.loaded_models() if m not in failed]
        if not others:
            return failed[0].engine.exit_code
        for model in failed:
            log.error("model %s failed (%s); the others serve on", model.name, model.engine.fatal)
            self.models.drop(model)
        self.engine, self.status = self.models.started.engine, self.models.started.status
        self.engine.on_crash = self._record_crash
        return None

    # ---- bodies ------------------------------------------------------------------------------
    def status_body(self) -> dict[str, Any]:
        return status_body(self)
