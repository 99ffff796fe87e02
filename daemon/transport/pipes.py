"""The inproc pipe from the engine thread to the transport, and the probe of a live daemon."""

from __future__ import annotations

import zmq

from moed.protocol import MessageType, decode, encode
from moed.protocol import messages as wire

EVENTS_ENDPOINT = "inproc://moed-events"
# The first byte of an event's meta frame (the rest is the msgpack request id).
TERMINAL_FLAG = b"T"
TOKEN_FLAG = b"t"  # counted by the transport, so a cancel can say how many tokens had gone out
OTHER_FLAG = b"e"


class ZmqEventSink:
    """The engine's end of the event pipe; created on the engine thread (ZMQ sockets are per
    thread)."""

    def __init__(self, context: zmq.Context):
        self.socket = context.socket(zmq.PUSH)
        self.socket.setsockopt(zmq.SNDHWM, 0)
        self.socket.connect(EVENTS_ENDPOINT)

    def emit(self, identity: bytes, msg: dict, terminal: bool = False) -> None:
        flag = TERMINAL_FLAG if terminal else TOKEN_FLAG if msg["type"] == "token" else OTHER_FLAG
        # The flag and the request id ride in one small frame, so the transport never decodes a
        # message (and takes three frames per event, not four: it runs once per token).
        self.socket.send_multipart([identity, encode(msg), flag + encode(msg["id"])])


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
