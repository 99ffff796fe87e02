"""msgpack codec. Strict: no ext types, no pickles, bounded sizes and depth, str keys only."""

from __future__ import annotations

from typing import Any

import msgpack

from .errors import ErrorCode, ProtocolError
from .messages import Message

# One frame is one message; anything larger is refused before decoding.
MAX_FRAME_BYTES = 4 * 1024 * 1024
# No message nests deeper than this (a tool schema of about 25 levels fits); deeper is refused,
# not recursed into.
MAX_DEPTH = 32
_PLAIN = (str, bytes, int, float, bool, type(None))
# Keys read while looking for the `id` of a refused frame (a request has a handful of fields).
_PEEK_KEYS = 64


def encode(msg: Message) -> bytes:
    frame: bytes = msgpack.packb(msg, use_bin_type=True)  # msgpack ships no types
    return frame


def decode(frame: bytes, max_bytes: int = MAX_FRAME_BYTES) -> Any:
    if len(frame) > max_bytes:
        raise ProtocolError(
            ErrorCode.FRAME_TOO_LARGE, f"frame of {len(frame)} bytes exceeds {max_bytes}"
        )
    try:
        value = msgpack.unpackb(
            frame,
            raw=False,
            strict_map_key=True,
            ext_hook=_refuse_ext,
        )
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack raises several unrelated types for garbage
        raise ProtocolError(
            ErrorCode.BAD_FRAME, f"frame is not valid msgpack: {exc.__class__.__name__}"
        ) from None
    _check_plain(value)
    return value


def peek_id(frame: bytes) -> str | int | None:
    """The top-level `id` of a frame that `decode` refused (too large, nested too deep), so the
    refusal can name its request: read the map's keys one by one, skipping the values."""
    try:
        unpacker = msgpack.Unpacker(raw=False, strict_map_key=True, max_buffer_size=len(frame))
        unpacker.feed(frame)
        for _ in range(min(unpacker.read_map_header(), _PEEK_KEYS)):
            key = unpacker.unpack()
            if key != "id":
                unpacker.skip()
                continue
            value = unpacker.unpack()
            # msgpack's ints fit 64 bits; a bool is not an id.
            return value if isinstance(value, str | int) and not isinstance(value, bool) else None
    except Exception:  # garbage, a nested key, ext types: there is no id to give
        return None
    return None


def _refuse_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(ErrorCode.BAD_FRAME, f"msgpack extension type {code} is not allowed")


def _check_plain(value: Any) -> None:
    """Refuse what ext_hook never sees: msgpack decodes the timestamp extension (-1) itself."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, _PLAIN):
            continue
        if depth >= MAX_DEPTH:
            raise ProtocolError(ErrorCode.BAD_FRAME, f"message nests deeper than {MAX_DEPTH}")
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
        else:
            raise ProtocolError(
                ErrorCode.BAD_FRAME,
                f"msgpack extension type ({type(item).__name__}) is not allowed",
            )
