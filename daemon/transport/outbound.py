"""Sending to clients without letting one of them grow the daemon's memory.

Policy (PROTOCOL.md, "Flow control"): each connection has a send queue of `client_send_hwm`
messages. A client that lets it fill is a slow consumer: its generations are cancelled and each
ends with a retryable `slow_consumer` error, delivered once the client reads again (or dropped
after `OWED_TTL_S`); control replies to it are dropped while its queue is full. A client whose
connection is gone has its generations cancelled at the first failed send.
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Callable

import zmq

log = logging.getLogger("moed.server")

OWED_TTL_S = 30.0  # how long a slow client's terminal errors wait for it to read again
_GONE = (errno.EHOSTUNREACH, zmq.EHOSTUNREACH)
_MORE, _NOBLOCK = int(zmq.SNDMORE | zmq.NOBLOCK), int(zmq.NOBLOCK)


class Outbound:
    def __init__(
        self,
        router: zmq.Socket[bytes],
        on_full: Callable[[bytes], list[bytes]],
        on_gone: Callable[[bytes], None],
    ):
        self.router = router
        self._on_full = on_full  # cancels the client's streams; returns their terminal frames
        self._on_gone = on_gone
        self._owed: dict[bytes, tuple[float, list[bytes]]] = {}

    def send(self, identity: bytes, envelope: list[bytes], frame: bytes) -> None:
        if identity in self._owed:
            return  # a slow consumer: nothing more until its terminal errors went out
        try:
            if envelope:
                self.router.send_multipart([identity, *envelope, frame], zmq.NOBLOCK)
            else:  # the per-token path: two sends, without send_multipart's list and loop
                self.router.send(identity, _MORE)
                self.router.send(frame, _NOBLOCK)
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EAGAIN:
                log.warning("client %s stopped reading; cancelling its streams", identity.hex())
                self._owed[identity] = (time.monotonic() + OWED_TTL_S, self._on_full(identity))
            elif exc.errno in _GONE:
                self._on_gone(identity)
            else:
                raise

    def retry_owed(self) -> None:
        """Deliver slow consumers' terminal errors as room appears; forget them after the TTL."""
        now = time.monotonic()
        for identity, (deadline, frames) in list(self._owed.items()):
            while frames:
                try:
                    self.router.send_multipart([identity, frames[0]], zmq.NOBLOCK)
                    frames.pop(0)
                except zmq.ZMQError as exc:
                    if exc.errno not in _GONE and exc.errno != zmq.EAGAIN:
                        raise
                    if exc.errno in _GONE:
                        frames.clear()
                    break
            if not frames or now > deadline:
                del self._owed[identity]

    @property
    def slow_clients(self) -> int:
        return len(self._owed)
