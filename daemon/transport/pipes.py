"""The inproc pipe from the engine thread to the transport."""

from __future__ import annotations

import struct

import zmq

from moed.protocol import TERMINAL_EVENTS, EngineEvent, TokenEvent, encode
from moed.protocol.generate import RequestId

EVENTS_ENDPOINT = "inproc://moed-events"
# An event's flag: how the transport treats it without decoding the message.
TERMINAL_FLAG = b"T"
TOKEN_FLAG = b"t"  # counted by the transport, so a cancel can say how many tokens had gone out
OTHER_FLAG = b"e"
# One frame per event: flag, lengths, the client's identity, the msgpack request id, the message.
# Every frame is a send or recv that releases the GIL and lets the other thread take it: one frame
# per token instead of four halves those hand-offs between the engine and the transport.
_HEAD = struct.Struct(">cBI")


def pack_event(flag: bytes, identity: bytes, id_bytes: bytes, frame: bytes) -> bytes:
    return b"".join((_HEAD.pack(flag, len(identity), len(id_bytes)), identity, id_bytes, frame))


def unpack_event(event: bytes) -> tuple[bytes, bytes, bytes, bytes]:
    """(flag, identity, msgpack request id, message frame) of one packed event."""
    flag, n_identity, n_id = _HEAD.unpack_from(event)
    at = _HEAD.size
    ids_at = at + n_identity
    frame_at = ids_at + n_id
    return flag, event[at:ids_at], event[ids_at:frame_at], event[frame_at:]


class ZmqEventSink:
    """The engine's end of the event pipe; created on the engine thread (ZMQ sockets are per
    thread)."""

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]]):
        self.socket = context.socket(zmq.PUSH)
        self.socket.setsockopt(zmq.SNDHWM, 0)
        self.socket.connect(EVENTS_ENDPOINT)

    def emit(self, identity: bytes, request_id: RequestId, event: EngineEvent) -> None:
        flag = (
            TERMINAL_FLAG
            if isinstance(event, TERMINAL_EVENTS)
            else TOKEN_FLAG
            if isinstance(event, TokenEvent)
            else OTHER_FLAG
        )
        # The request id is encoded apart, so the transport never decodes a message.
        msg = event.to_wire(request_id)
        self.socket.send(pack_event(flag, identity, encode(msg["id"]), encode(msg)))
