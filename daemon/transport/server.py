"""The daemon's transport: a ZMQ ROUTER on the main thread, frames in, queue to the engine,
events out.

Control messages (status, cancel, shed, shutdown, ping) are answered here and never wait behind a
generation. Startup → main loop → drain; signal handlers only set flags.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import psutil
import zmq

from moed.daemon import __version__
from moed.daemon.config import ServeConfig
from moed.daemon.engine.loop import Engine
from moed.daemon.engine.request import GenerateJob, RequestKey
from moed.daemon.engine.status import DaemonState, EngineStatus
from moed.daemon.exit_codes import DaemonExit
from moed.daemon.model.chat_template import prompt_token_ids
from moed.daemon.runtime import crashlog
from moed.daemon.telemetry import LiveTelemetry
from moed.daemon.watchdog.events import read_state as read_watchdog_state
from moed.protocol import (
    MAX_FRAME_BYTES,
    PROTOCOL_MAJOR,
    PROTOCOL_MINOR,
    ErrorCode,
    MessageType,
    ProtocolError,
    ShedLevel,
    decode,
    encode,
    validate_request,
)
from moed.protocol import messages as wire
from moed.protocol.paths import endpoint_for, ensure_private_dir

log = logging.getLogger("moed.server")

EVENTS_ENDPOINT = "inproc://moed-events"
_TERMINAL_FLAG = b"T"
_TOKEN_FLAG = b"t"  # counted by the transport, so a cancel can say how many tokens had gone out


class AlreadyRunning(RuntimeError):
    pass


class ZmqEventSink:
    """The engine's end of the event pipe; created on the engine thread (ZMQ sockets are per
    thread)."""

    def __init__(self, context: zmq.Context):
        self.socket = context.socket(zmq.PUSH)
        self.socket.setsockopt(zmq.SNDHWM, 0)
        self.socket.connect(EVENTS_ENDPOINT)

    def emit(self, identity: bytes, msg: dict, terminal: bool = False) -> None:
        flag = _TERMINAL_FLAG if terminal else _TOKEN_FLAG if msg["type"] == "token" else b""
        # The request id rides in its own small frame, so the transport never decodes a message.
        self.socket.send_multipart([identity, encode(msg), flag, encode(msg["id"])])


def probe_live_daemon(endpoint: str, context: zmq.Context, timeout_s: float = 0.5) -> dict | None:
    """Ping whoever owns the endpoint; return its answer, or None when nobody answers."""
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send(encode(wire.request(MessageType.PING, "probe")))
        if sock.poll(int(timeout_s * 1000)):
            return decode(sock.recv())
        return None
    finally:
        sock.close()


@dataclass
class Server:
    serve: ServeConfig
    model_path: Path
    boot_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    status: EngineStatus = field(default_factory=EngineStatus)
    extra_welcome: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.context = zmq.Context.instance()
        self.endpoint = endpoint_for(self.serve.socket)
        self._pending: dict[
            RequestKey, int
        ] = {}  # admitted generate requests not yet terminal: tokens sent
        self._order: list[RequestKey] = []
        self._draining = False
        self._restart_reason: str | None = None
        self._drain_deadline = 0.0
        self._stop_requested = threading.Event()
        # Set by a pipeline group's monitor thread: another rank died or stalled.
        self.group_failure: str | None = None
        # After crashes: count an unclean previous exit, back the cache budget off, or refuse to
        # start.
        self.start_plan = crashlog.plan_start(
            self.serve.state_dir, self.serve.restart_budget, self.serve.restart_window_s
        )
        self.budget_backoff = self._back_off_budget()
        self.engine = Engine(
            self.serve, self.model_path, lambda: ZmqEventSink(self.context), self.status
        )
        self.engine.on_crash = self._record_crash
        self._process = psutil.Process()
        self.telemetry = LiveTelemetry(
            self.status_body,
            lambda: self.engine.loaded and self.engine.loaded.streamer,
            lambda: self.status.get("tokens_generated"),
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
        self.router.setsockopt(zmq.SNDHWM, 0)
        self.router.bind(self.endpoint)
        os.chmod(self.serve.socket, 0o600)
        self.status.update(
            pid=os.getpid(),
            boot_id=self.boot_id,
            socket=str(self.serve.socket),
            version=__version__,
        )

    def _back_off_budget(self) -> dict | None:
        """Shrink the expert cache budget by the crash backoff factor (resolved to bytes first)."""
        plan = self.start_plan
        if plan.budget_factor >= 1.0:
            return None
        info = {**plan.describe(), "budget": self.serve.cache_budget}
        if self.serve.resident:
            return info  # nothing to shrink: every expert is resident by request
        try:
            from moed.daemon.experts import plan_memory
            from moed.daemon.model.loader import streaming_config

            model_config = json.loads((self.model_path / "config.json").read_text())
            full = plan_memory(
                self.model_path, streaming_config(self.serve, model_config)
            ).cache_budget_bytes
        except (
            Exception
        ) as exc:  # a model that cannot be planned fails at load with a better message
            log.warning("cache budget backoff skipped: %s", exc)
            return info
        scaled = crashlog.scale_budget(full, plan.budget_factor)
        self.serve = replace(self.serve, cache_budget=str(scaled))
        log.warning(
            "%d recent crash(es): expert cache budget backed off to %.0f%% (%d -> %d bytes)",
            plan.recent_crashes,
            100 * plan.budget_factor,
            full,
            scaled,
        )
        return {**info, "budget_bytes_full": full, "budget_bytes": scaled}

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
        self.engine.start()
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self.events, zmq.POLLIN)
        try:
            while True:
                if self._stop_requested.is_set() and not self._draining:
                    self._begin_drain()
                if self._draining and (
                    not self._pending or time.monotonic() > self._drain_deadline
                ):
                    break
                if self.engine.fatal is not None:
                    self._flush_events(poller)
                    return self.engine.exit_code
                if self.group_failure is not None:
                    return self._group_failed(poller)
                for sock, _ in poller.poll(50):
                    if sock is self.router:
                        self._receive_all()
                    else:
                        self._forward_events()
            self.engine.stop()  # what is still in flight ends with `shutting_down`
            self.engine.thread.join(timeout=5.0)
            self._flush_events(poller)
            if self.engine.thread.is_alive():
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

    def _group_failed(self, poller: zmq.Poller) -> int:
        """A pipeline rank is gone: the engine may be stuck in a collective, so the transport
        itself ends every request in flight with a retryable error, then the group restarts."""
        self._flush_events(poller)  # tokens already produced go out first
        message = f"pipeline {self.group_failure}; the daemon restarts the group"
        self.status.update(state=DaemonState.FAILED, error=message)
        self._record_crash(crashlog.CrashKind.RANK_FAILED, message)
        for identity, req_id in list(self._pending):
            self._send(identity, [], encode(wire.error(req_id, ErrorCode.RANK_FAILED, message)))
        self._pending.clear()
        return DaemonExit.RANK_FAILED

    def _begin_drain(self) -> None:
        self._draining = True
        self._drain_deadline = time.monotonic() + self.serve.drain_timeout_s
        self.status.update(state=DaemonState.DRAINING)
        log.info(
            "draining %d request(s), deadline %.1fs", len(self._pending), self.serve.drain_timeout_s
        )

    def _flush_events(self, poller: zmq.Poller) -> None:
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline and poller.poll(20):
            self._forward_events()

    def _close(self) -> None:
        self.telemetry.close()
        self.router.close(linger=0)
        self.events.close(linger=0)
        try:
            self.serve.socket.unlink()
        except FileNotFoundError:
            pass

    # ---- inbound -----------------------------------------------------------------------------
    def _receive_all(self) -> None:
        while True:
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
            kind, request_id = validate_request(msg)
            reply = self._dispatch(identity, kind, msg)
        except ProtocolError as exc:
            reply = wire.error(
                request_id if isinstance(request_id, (str, int)) else None, exc.code, exc.message
            )
        except Exception as exc:  # a bug in one request must not take the daemon down
            log.exception("request handling failed")
            reply = wire.error(
                request_id if isinstance(request_id, (str, int)) else None,
                ErrorCode.INTERNAL,
                str(exc),
            )
        if reply is not None:
            self._send(identity, envelope, encode(reply))

    def _dispatch(self, identity: bytes, kind: MessageType, msg: dict) -> dict | None:
        req_id = msg["id"]
        if kind is MessageType.GENERATE:
            return self._admit(identity, msg)
        if kind is MessageType.HELLO:
            return wire.welcome(req_id, **self._welcome_body())
        if kind is MessageType.PING:
            return wire.result(
                req_id, pong=True, boot_id=self.boot_id, pid=os.getpid(), time=time.time()
            )
        if kind is MessageType.STATUS:
            return wire.result(req_id, **self.status_body())
        if kind is MessageType.CANCEL:
            key = (identity, msg["target"])
            self._forward_events()  # tokens already produced go out first, and are counted
            found = key in self._pending
            if found:
                self.engine.cancel(key)
            return wire.result(req_id, cancelled=found, tokens_sent=self._pending.get(key, 0))
        if kind is MessageType.SHED:
            level = ShedLevel(msg.get("level") or ShedLevel.CACHE.value)
            log.warning("shed requested: level=%s reason=%s", level.value, msg.get("reason"))
            self.engine.shed(level)
            return wire.result(req_id, accepted=True, level=level.value)
        if kind is MessageType.SHUTDOWN:
            if msg.get("restart"):
                # Memory pressure: exit non-zero after the drain so launchd/systemd restart us
                # smaller.
                self._restart_reason = msg.get("reason") or "restart requested"
            self.request_stop(f"shutdown request: {msg.get('reason') or 'no reason given'}")
            return wire.result(req_id, accepted=True, pending=len(self._pending))
        if kind is MessageType.STATS:
            return wire.result(req_id, **self.telemetry.stats())
        if kind is MessageType.METRICS:
            return wire.result(req_id, text=self.telemetry.metrics_text())
        if kind is MessageType.COUNT_TOKENS:
            return wire.result(req_id, tokens=self._count_tokens(msg))
        raise ProtocolError(ErrorCode.UNKNOWN_TYPE, f"{kind.value!r} is not handled")

    def _admit(self, identity: bytes, msg: dict) -> dict | None:
        key = (identity, msg["id"])
        if self._draining:
            raise ProtocolError(
                ErrorCode.SHUTTING_DOWN, "the daemon is shutting down; retry after it restarts"
            )
        if self.engine.fatal is not None:
            if self.engine.exit_code == DaemonExit.OUT_OF_MEMORY:
                raise ProtocolError(
                    ErrorCode.OUT_OF_MEMORY,
                    f"the daemon ran out of memory and is restarting: {self.engine.fatal}",
                )
            raise ProtocolError(
                ErrorCode.INTERNAL, f"the model failed to load: {self.engine.fatal}"
            )
        if key in self._pending:
            raise ProtocolError(
                ErrorCode.DUPLICATE_ID, f"request id {msg['id']!r} is already in flight"
            )
        if len(self._pending) >= self.serve.max_pending:
            raise ProtocolError(
                ErrorCode.OVERLOADED, f"{len(self._pending)} requests in flight; retry later"
            )
        self._check_model(msg.get("model"))
        prompt = msg.get("prompt")
        # A cheap bound before tokenizing: a token is at least one byte of text.
        if prompt is not None and len(prompt) > self.serve.max_prompt_tokens * 32:
            raise ProtocolError(
                ErrorCode.PROMPT_TOO_LONG, f"prompt of {len(prompt)} characters is too long"
            )
        if (
            len(msg.get("prompt_ids") or []) + len(msg.get("resume_ids") or [])
            > self.serve.max_prompt_tokens
        ):
            raise ProtocolError(
                ErrorCode.PROMPT_TOO_LONG, f"prompt exceeds {self.serve.max_prompt_tokens} tokens"
            )
        self._pending[key] = 0  # tokens sent so far
        self.engine.submit(GenerateJob(identity, msg))
        return None

    def _count_tokens(self, msg: dict) -> int:
        # The model's tokenizer, kept once seen: an idle (unloaded) daemon counts without reloading.
        tokenizer = getattr(self, "_tokenizer", None)
        if tokenizer is None:
            loaded = self.engine.loaded
            if loaded is not None:
                tokenizer = loaded.tokenizer
            else:
                from mlx_lm.utils import load_tokenizer

                tokenizer = load_tokenizer(self.model_path)
            self._tokenizer = tokenizer
        # The tokenizer is thread-safe for encoding; counting never waits behind a generation.
        return len(prompt_token_ids(tokenizer, msg))

    def _check_model(self, name: str | None) -> None:
        if not name:
            return
        accepted = {self.serve.model, str(self.model_path), self.model_path.name}
        if name not in accepted:
            raise ProtocolError(
                ErrorCode.MODEL_NOT_FOUND,
                f"model {name!r} is not served here; this daemon serves {self.serve.model!r}",
            )

    # ---- outbound ----------------------------------------------------------------------------
    def _forward_events(self) -> None:
        while True:
            try:
                identity, frame, flag, id_frame = self.events.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if flag:
                key = (identity, decode(id_frame))
                if flag == _TERMINAL_FLAG:
                    self._pending.pop(key, None)
                elif key in self._pending:
                    self._pending[key] += 1
            self._send(identity, [], frame)

    def _send(self, identity: bytes, envelope: list[bytes], frame: bytes) -> None:
        try:
            self.router.send_multipart([identity, *envelope, frame], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            if exc.errno in (errno.EHOSTUNREACH, zmq.EHOSTUNREACH, zmq.EAGAIN):
                self._client_gone(identity)
            else:
                raise

    def _client_gone(self, identity: bytes) -> None:
        for key in [k for k in self._pending if k[0] == identity]:
            log.info("client gone; cancelling request %r", key[1])
            del self._pending[key]  # once: its later frames are undeliverable too
            self.engine.cancel(key)

    # ---- bodies ------------------------------------------------------------------------------
    def _welcome_body(self) -> dict:
        snap = self.status.snapshot()
        return {
            "protocol": {"major": PROTOCOL_MAJOR, "minor": PROTOCOL_MINOR},
            "boot_id": self.boot_id,
            "pid": os.getpid(),
            "version": __version__,
            "state": snap["state"],
            "model": snap.get("model")
            or {"path": str(self.model_path), "name": self.model_path.name},
            "limits": {
                "max_prompt_tokens": self.serve.max_prompt_tokens,
                "max_tokens": self.serve.max_tokens_limit,
                "max_frame_bytes": MAX_FRAME_BYTES,
                "max_pending": self.serve.max_pending,
            },
            "last_crash": self.start_plan.last_crash,
            "budget_backoff": self.budget_backoff,
            **self.extra_welcome,
        }

    def status_body(self) -> dict[str, Any]:
        snap = self.status.snapshot()
        snap["pending_requests"] = len(self._pending)
        snap["boot_id"] = self.boot_id
        snap["pid"] = os.getpid()
        snap["uptime_s"] = time.time() - snap["started_at"]
        snap["rss_bytes"] = self._process.memory_info().rss
        snap["last_crash"] = self.start_plan.last_crash
        snap["recent_crashes"] = (
            self.start_plan.recent_crashes
        )  # crash restarts within the restart window
        snap["budget_backoff"] = self.budget_backoff
        snap["watchdog"] = _watchdog_summary(self.serve.state_dir)
        snap.update(self.extra_welcome)
        return snap


def _watchdog_summary(state_dir: Path) -> dict | None:
    """The watchdog's published state (it shares the state directory), for `moe status`."""
    state = read_watchdog_state(state_dir)
    if state is None:
        return None
    keep = ("running", "state", "reason", "last_action", "pid", "updated_at")
    return {k: state.get(k) for k in keep}
