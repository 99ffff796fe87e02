"""A request body's JSON read at the edge: nesting bounded, text that is valid Unicode, numbers the
wire can carry. Whatever passes can be encoded into a `generate` frame without an exception, so a
hostile body is a 400 naming what is wrong, never a 500 or a RecursionError."""

from __future__ import annotations

import json
import math
from typing import Any

from .errors import invalid

# Deeper than any request of the three APIs needs (a tool schema of 40 levels still fits); the
# daemon's own frame limit (welcome.limits.max_depth) is checked again on the encoded message.
MAX_JSON_DEPTH = 64
# msgpack carries signed 64-bit integers; larger ones would fail to encode.
INT_MIN, INT_MAX = -(2**63), 2**63 - 1
_MAX_INT_DIGITS = len(str(INT_MIN))


def _parse_int(text: str) -> int:
    # Bounded before int() runs: a million digits would be slow, and over 4300 a ValueError.
    if len(text) > _MAX_INT_DIGITS or not INT_MIN <= (value := int(text)) <= INT_MAX:
        raise _Refused(f"the integer {text[:24]}{'...' if len(text) > 24 else ''} is out of range")
    return value


def _parse_constant(name: str) -> Any:
    raise _Refused(f"{name} is not a JSON number")


class _Refused(ValueError):
    """Raised from inside the parser's hooks; becomes the 400's message."""


def loads(raw: bytes, what: str = "the request body") -> Any:
    """The JSON value in `raw`, or an ApiError (400) that says why `what` is refused."""
    try:
        value = json.loads(raw, parse_int=_parse_int, parse_constant=_parse_constant)
    except _Refused as exc:
        raise invalid(f"{what} is refused: {exc}") from None
    except RecursionError:  # the C scanner recurses; far deeper than MAX_JSON_DEPTH anyway
        raise invalid(_too_deep(what)) from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise invalid(f"{what} is not valid JSON: {exc}") from None
    check_value(value)
    return value


def check_value(value: Any) -> None:
    """Depth, lone surrogates and non-finite floats, walked without recursion. A path is kept as
    a (parent, key) chain and spelled out only for the error."""
    stack: list[tuple[Any, int, tuple | None]] = [(value, 0, None)]
    while stack:
        item, depth, path = stack.pop()
        if isinstance(item, str):
            _check_text(item, path)
        elif isinstance(item, float):
            if not math.isfinite(item):  # 1e999 parses as inf
                raise invalid(f"'{_spell(path)}' is a number out of range", _spell(path))
        elif isinstance(item, dict | list):
            if depth >= MAX_JSON_DEPTH:
                raise invalid(_too_deep("the request body"))
            if isinstance(item, dict):
                for key, child in item.items():
                    _check_text(key, (path, key))
                    stack.append((child, depth + 1, (path, key)))
            else:
                stack.extend((child, depth + 1, (path, i)) for i, child in enumerate(item))


def _check_text(text: str, path: tuple | None) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # "\ud800" escaped in JSON decodes to a lone surrogate
        where = _spell(path)
        raise invalid(
            f"'{where}' holds a lone UTF-16 surrogate (not a Unicode character)", where
        ) from None


def _spell(path: tuple | None) -> str:
    keys = []
    while path is not None:
        path, key = path
        keys.append(f"[{key}]" if isinstance(key, int) else f".{key}")
    return "".join(reversed(keys)).lstrip(".") or "body"


def _too_deep(what: str) -> str:
    return f"{what} nests deeper than {MAX_JSON_DEPTH} levels"
