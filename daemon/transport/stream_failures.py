"""Streams the transport ends itself, with their typed error: a client that stopped reading
(`slow_consumer`) or vanished, a model that passed its progress deadline (`engine_stalled`, its
own streams only), a pipeline rank gone (every stream). The engine is told to cancel each; its
later events for them are dropped (streams.py)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from moed.daemon.config import ServeConfig
from moed.daemon.engine.loop import Engine
from moed.daemon.engine.request import RequestKey
from moed.daemon.transport.model_progress import newly_stalled
from moed.daemon.transport.model_set import ModelSet
from moed.daemon.transport.streams import StreamTable
from moed.protocol import ErrorCode, encode
from moed.protocol import messages as wire

PROGRESS_CHECK_S = 0.25

log = logging.getLogger("moed.server")

# Sends one frame to a client: its identity, the envelope, the frame (outbound.py Outbound.send).
SendFrame = Callable[[bytes, list[bytes], bytes], None]


class StreamFailures:
    """Ends the transport's streams (streams.py StreamTable) with an error and cancels them in the
    engine that runs each (`engine_of`)."""

    def __init__(
        self,
        serve: ServeConfig,
        streams: StreamTable,
        models: ModelSet,
        engine_of: Callable[[RequestKey], Engine],
    ) -> None:
        self._serve = serve
        self._streams = streams
        self._models = models
        self._engine_of = engine_of
        self._next_progress_check = 0.0

    def fail(self, keys: list[RequestKey], code: ErrorCode, message: str) -> list[bytes]:
        """End streams here (the engine cannot, or the client would not hear it); cancel there."""
        frames = []
        for key in keys:
            self._streams.fail(key)
            self._engine_of(key).cancel(key)
            self._models.ended(key)
            frames.append(encode(wire.error(key[1], code, message)))
        return frames

    def client_slow(self, identity: bytes) -> list[bytes]:
        message = (
            f"this client did not read its replies (over {self._serve.client_send_hwm} queued); "
            "its streams were cancelled"
        )
        return self.fail(self._streams.keys_of(identity), ErrorCode.SLOW_CONSUMER, message)

    def client_gone(self, identity: bytes) -> None:
        for key in self._streams.keys_of(identity):
            log.info("client gone; cancelling request %r", key[1])
        self.fail(self._streams.keys_of(identity), ErrorCode.INTERNAL, "client gone")

    def check_progress(self, send: SendFrame) -> None:
        """Every PROGRESS_CHECK_S: a model newly past its progress deadline fails its streams."""
        now = time.monotonic()
        if now < self._next_progress_check:
            return
        self._next_progress_check = now + PROGRESS_CHECK_S
        for model in newly_stalled(self._models):  # only its own streams fail
            message = f"model {model.name!r}: {model.progress.message()}"
            log.error("%s; failing %d request(s)", message, len(model.streams))
            self.fail_all(send, ErrorCode.ENGINE_STALLED, message, list(model.streams))

    def fail_all(
        self, send: SendFrame, code: ErrorCode, message: str, keys: list[RequestKey] | None = None
    ) -> None:
        """End `keys` (none: every open stream) and send each client its error."""
        keys = list(self._streams.open) if keys is None else keys
        for key, frame in zip(keys, self.fail(keys, code, message)):
            send(key[0], [], frame)
