"""Typed reads of a JSON request body: a wrong type or range is an ApiError naming the field."""

from __future__ import annotations

import math
from typing import Any

from starlette.requests import Request

from moed.protocol.generate import MAX_SALT_CHARS

from . import json_edge
from .errors import invalid

_MISSING = object()
_NAMES = {
    str: "a string",
    bool: "a boolean",
    int: "an integer",
    list: "an array",
    dict: "an object",
}


async def json_body(request: Request) -> dict:
    """The body as a JSON object; anything else is an invalid request."""
    body = json_edge.loads(await request.body())
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    return body


def get(body: dict, name: str, kind: type, default: Any = None, *, prefix: str = "") -> Any:
    """body[name] checked against `kind` (float accepts integers; int refuses booleans)."""
    value = body.get(name, _MISSING)
    if value is _MISSING or value is None:
        return default
    label = prefix + name
    if kind is float:
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
        ):
            raise invalid(f"'{label}' must be a finite number", label)
        return float(value)
    if isinstance(value, bool) and kind is not bool:
        raise invalid(f"'{label}' must be {_NAMES[kind]}", label)
    if not isinstance(value, kind):
        raise invalid(f"'{label}' must be {_NAMES[kind]}", label)
    return value


def required(body: dict, name: str, kind: type, *, prefix: str = "") -> Any:
    value = get(body, name, kind, prefix=prefix)
    if value is None:
        raise invalid(f"'{prefix + name}' is required", prefix + name)
    return value


def at_least(value: Any, minimum: float, name: str) -> Any:
    if value is not None and value < minimum:
        raise invalid(f"'{name}' must be at least {minimum}", name)
    return value


def stop_list(value: Any, name: str, limit: int = 16) -> tuple[str, ...]:
    """A stop string or a list of them (OpenAI allows both) as a tuple of non-empty strings."""
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
        raise invalid(f"'{name}' must be a non-empty string or a list of them", name)
    if len(items) > limit:
        raise invalid(f"'{name}' allows at most {limit} sequences", name)
    return tuple(items)


def cache_salt(body: dict) -> str | None:
    """vLLM's `cache_salt` (OpenAI's chat, completions and Responses bodies): requests with
    different salts never share a cached prefix. A non-empty string when given."""
    salt = get(body, "cache_salt", str)
    if salt is not None and not 0 < len(salt) <= MAX_SALT_CHARS:
        raise invalid(
            f"'cache_salt' must be a non-empty string of at most {MAX_SALT_CHARS} characters",
            "cache_salt",
        )
    return salt
