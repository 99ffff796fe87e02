"""Is a live moed on this socket? Asked before binding it (the daemon, a pipeline rank's control
socket), so that a stale socket file is removed and a live one is never stolen."""

from __future__ import annotations

from pathlib import Path

import zmq

from moed.protocol import MessageType, decode, encode
from moed.protocol import messages as wire
from moed.protocol.paths import nobody_listens

IPC = "ipc://"


def probe_live_daemon(endpoint: str, context: zmq.Context, timeout_s: float = 0.5) -> dict | None:
    """Ping whoever owns the endpoint; return its answer, or None when nobody answers (at once
    for an ipc socket whose connect is refused: a file left by a daemon that died)."""
    if endpoint.startswith(IPC) and nobody_listens(Path(endpoint[len(IPC) :])):
        return None
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
