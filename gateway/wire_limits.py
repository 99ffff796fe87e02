"""The size and depth a request takes once encoded, checked against the daemon's own limits
(welcome.limits) before it is sent: a body that grows past the frame limit when encoded (floats
in msgpack, a prompt's escapes) is a 413 from the gateway, not a frame the daemon refuses.

Every frame the gateway sends with a client's content in it (`generate`, and the `count_tokens`
that a budget check or /v1/messages/count_tokens sends first) goes through `check_frame`: a frame
the daemon would refuse as malformed (`bad_frame`, a 500: the sender's fault) never leaves."""

from __future__ import annotations

from moed.client import ClientError
from moed.protocol import MAX_FRAME_BYTES, GenerateRequest, MessageType, encode
from moed.protocol import messages as wire
from moed.protocol.codec import MAX_DEPTH

from .errors import ApiError, ErrorKind, from_client_error, invalid

# The id the client will put on the frame is at most this long (prefix-kind-counter).
_ID_ROOM = "x" * 64


async def check_frame(client, kind: MessageType, fields: dict) -> dict:
    """Connect (the welcome carries the daemon's limits) and check the `kind` frame these fields
    make against them, before it is sent; the welcome, for the caller's use."""
    return await _check_message(client, wire.request(kind, _ID_ROOM, **fields))


async def check_generate(client, req: GenerateRequest) -> dict:
    """`check_frame` for the `generate` frame of `req`."""
    return await _check_message(client, req.to_wire(_ID_ROOM))


async def _check_message(client, message: dict) -> dict:
    try:
        welcome = await client.connect()
    except ClientError as exc:
        raise from_client_error(exc) from None
    check_message(message, welcome.get("limits") or {})
    return welcome


def check_message(message: dict, limits: dict) -> None:
    """Raise an ApiError if this frame would exceed the daemon's limits."""
    max_depth = _limit(limits, "max_depth", MAX_DEPTH)
    max_bytes = _limit(limits, "max_frame_bytes", MAX_FRAME_BYTES)
    depth = _depth(message, max_depth)
    if depth >= max_depth:
        raise invalid(f"the request nests deeper than the daemon accepts ({max_depth} levels)")
    size = len(encode(message))
    if size > max_bytes:
        raise ApiError(
            ErrorKind.TOO_LARGE,
            f"the request takes {size} bytes once encoded; the daemon accepts {max_bytes}",
        )


def _limit(limits: dict, name: str, default: int) -> int:
    value = limits.get(name)
    return value if isinstance(value, int) and value > 0 else default


def _depth(value, stop: int) -> int:
    """How deep `value` nests as the daemon counts it (codec._check_plain), up to `stop`."""
    deepest = 0
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list | tuple):
            deepest = max(deepest, depth)
            if depth >= stop:
                return depth
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
    return deepest
