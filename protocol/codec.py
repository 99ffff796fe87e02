"""msgpack codec. Strict: no ext types, no pickles, bounded sizes, str keys only."""

from __future__ import annotations

from typing import Any

import msgpack

from .errors import ErrorCode, ProtocolError

# One frame is one message; anything larger is refused before decoding.
MAX_FRAME_BYTES = 4 * 1024 * 1024


def encode(msg: dict) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


def decode(frame: bytes, max_bytes: int = MAX_FRAME_BYTES) -> Any:
    if len(frame) > max_bytes:
        raise ProtocolError(
            ErrorCode.FRAME_TOO_LARGE, f"frame of {len(frame)} bytes exceeds {max_bytes}"
        )
    try:
        return msgpack.unpackb(
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


def _refuse_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(ErrorCode.BAD_FRAME, f"msgpack extension type {code} is not allowed")
