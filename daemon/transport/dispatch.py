"""Control messages answered on the transport thread, never behind a generation: hello, ping,
status, cancel, shed, shutdown, stats, metrics, count_tokens, prefix_cache, models."""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any

from moed.daemon.transport.bodies import prefix_cache_reply, welcome_body
from moed.daemon.transport.model_verbs import models_reply
from moed.protocol import ErrorCode, GenerateRequest, MessageType, ProtocolError, ShedLevel
from moed.protocol import messages as wire

if TYPE_CHECKING:  # the Server whose verbs these are (server.py imports this module)
    from moed.daemon.transport.server import Server

log = logging.getLogger("moed.server")


def dispatch_control(
    self: Server, identity: bytes, kind: MessageType, msg: dict[str, Any]
) -> dict[str, Any] | None:
    """A validated control message's reply (None: none); `self` is the Server."""
    req_id = msg["id"]
    if kind is MessageType.HELLO:
        self.connections.admit_hello()  # past max_connections: `overloaded`, before fds run out
        return wire.welcome(req_id, **welcome_body(self))
    if kind is MessageType.PING:
        return wire.result(
            req_id, pong=True, boot_id=self.boot_id, pid=os.getpid(), time=time.time()
        )
    if kind is MessageType.STATUS:
        return wire.result(req_id, **self.status_body())
    if kind is MessageType.CANCEL:
        key = (identity, msg["target"])
        self._forward_events()  # tokens already produced go out first, and are counted
        stream = self._streams.open.get(key)
        if stream is not None and not stream.cancelled:
            stream.cancelled = True  # from here: no token, then `done` (cancelled)
            self._engine_of(key).cancel(key)
        sent = stream.tokens_sent if stream else 0
        return wire.result(req_id, cancelled=stream is not None, tokens_sent=sent)
    if kind in (MessageType.SHED, MessageType.SHUTDOWN):
        self.control_token.require(kind.value, msg.get("token"))
    if kind is MessageType.SHED:
        level = ShedLevel(msg.get("level") or ShedLevel.CACHE.value)
        log.warning("shed requested: level=%s reason=%s", level.value, msg.get("reason"))
        for model in self.models.loaded_models():
            model.engine.shed(level)
        return wire.result(req_id, accepted=True, level=level.value)
    if kind is MessageType.SHUTDOWN:
        if msg.get("restart"):
            # Memory pressure: exit non-zero after the drain so launchd/systemd restart us
            # smaller.
            self._restart_reason = msg.get("reason") or "restart requested"
        self.request_stop(f"shutdown request: {msg.get('reason') or 'no reason given'}")
        return wire.result(req_id, accepted=True, pending=len(self._streams))
    if kind is MessageType.STATS:
        return wire.result(req_id, **self.telemetry.stats())
    if kind is MessageType.METRICS:
        return wire.result(req_id, text=self.telemetry.metrics_text())
    if kind is MessageType.COUNT_TOKENS:
        # A count_tokens carries a generate's prompt fields, checked under the same rules.
        prompt = GenerateRequest.from_checked(msg)
        model = self.models.route(prompt.model)
        return wire.result(req_id, tokens=model.tokens.count(prompt))
    if kind is MessageType.PREFIX_CACHE:
        return prefix_cache_reply(self, req_id, msg)
    if kind is MessageType.MODELS:
        return models_reply(self.models, req_id, msg)
    raise ProtocolError(ErrorCode.UNKNOWN_TYPE, f"{kind.value!r} is not handled")
