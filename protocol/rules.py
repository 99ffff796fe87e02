"""The rules a field's value must follow (type and range), and the loaded model's limits some of
them read. Each generate field declares its rule beside its type (protocol/generate.py); the
control messages' rules are in validation.py's table."""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

from .errors import ErrorCode, ProtocolError
from .messages import ShedLevel
from .units import parse_keep_alive

# Bounds that hold without a model: ids fit the int32 MLX indexes with, strings stay printable.
MAX_TOKEN_ID = 2**31 - 1
MAX_ID_CHARS = 256
MAX_TEXT_CHARS = 4096  # short strings: client names, reasons, model names
INT64_MAX = 2**63 - 1


@dataclass(frozen=True)
class Limits:
    """What the loaded model and the configuration allow; built once by the daemon."""

    vocab_size: int | None = None  # token ids must be below this
    context_tokens: int | None = None  # prompt + resume + max_tokens must fit
    max_prompt_tokens: int = 32768
    max_tokens: int = 8192  # largest accepted `max_tokens`
    default_max_tokens: int = 256
    telemetry_every: int = 16

    def describe(self) -> dict[str, int | None]:
        return {
            "vocab_size": self.vocab_size,
            "context_tokens": self.context_tokens,
            "max_prompt_tokens": self.max_prompt_tokens,
            "max_tokens": self.max_tokens,
            "default_max_tokens": self.default_max_tokens,
            "telemetry_every": self.telemetry_every,
        }


def refuse(where: str, message: str, code: ErrorCode = ErrorCode.INVALID_REQUEST) -> NoReturn:
    raise ProtocolError(code, f"{where}: {message}")


def type_name(value: Any) -> str:
    return {bool: "bool", int: "integer", float: "float", str: "string", bytes: "binary"}.get(
        type(value), type(value).__name__
    )


@dataclass(frozen=True)
class Rule:
    """One field's type and range; `check` raises ProtocolError naming the field."""

    required: bool = False

    def check(self, where: str, value: Any, limits: Limits | None) -> None:
        raise NotImplementedError


@dataclass(frozen=True)
class Int(Rule):
    lo: int = 0
    hi: int = INT64_MAX
    hi_from: Callable[[Limits], int | None] | None = None  # a bound from the loaded model

    def check(self, where: str, value: Any, limits: Limits | None) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            refuse(where, f"must be a msgpack integer, got {type_name(value)} {value!r:.40}")
        hi = self.hi
        if limits is not None and self.hi_from is not None:
            hi = min(hi, self.hi_from(limits) or hi)
        if not self.lo <= value <= hi:
            refuse(where, f"must be in [{self.lo}, {hi}], got {value}")


@dataclass(frozen=True)
class Number(Rule):
    lo: float = 0.0
    hi: float = math.inf
    lo_open: bool = False

    def check(self, where: str, value: Any, limits: Limits | None) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            refuse(where, f"must be a number, got {type_name(value)}")
        if not math.isfinite(value):
            refuse(where, f"must be finite, got {value}")
        low_ok = value > self.lo if self.lo_open else value >= self.lo
        if not (low_ok and value <= self.hi):
            bracket = "(" if self.lo_open else "["
            refuse(where, f"must be in {bracket}{self.lo:g}, {self.hi:g}], got {value}")


@dataclass(frozen=True)
class Str(Rule):
    max_chars: int = MAX_TEXT_CHARS
    non_empty: bool = False

    def check(self, where: str, value: Any, limits: Limits | None) -> None:
        if not isinstance(value, str):
            refuse(where, f"must be a string, got {type_name(value)}")
        if self.non_empty and not value:
            refuse(where, "must not be empty")
        if len(value) > self.max_chars:
            code = ErrorCode.PROMPT_TOO_LONG if where.endswith("'prompt'") else None
            refuse(
                where,
                f"is {len(value)} characters, over {self.max_chars}",
                code or ErrorCode.INVALID_REQUEST,
            )


@dataclass(frozen=True)
class Bool(Rule):
    def check(self, where: str, value: Any, limits: Limits | None) -> None:
        if not isinstance(value, bool):
            refuse(where, f"must be true or false, got {type_name(value)}")


@dataclass(frozen=True)
class OneOf(Rule):
    choices: type[enum.Enum] = ShedLevel

    def check(self, where: str, value: Any, limits: Limits | None) -> None:
        allowed = [c.value for c in self.choices]
        if value not in allowed:
            refuse(where, f"must be one of {', '.join(allowed)}, got {value!r:.40}")


@dataclass(frozen=True)
class RequestId(Rule):
    def check(self, where: str, value: Any, limits: Limits | None) -> None:
        if isinstance(value, str):
            if len(value) > MAX_ID_CHARS:
                refuse(where, f"is over {MAX_ID_CHARS} characters")
            return
        if isinstance(value, bool) or not isinstance(value, int):
            refuse(where, f"must be a string or a msgpack integer, got {type_name(value)}")
        if not -INT64_MAX <= value <= INT64_MAX:
            refuse(where, "must fit in 64 bits")


@dataclass(frozen=True)
class TokenIds(Rule):
    non_empty: bool = False

    def check(self, where: str, value: Any, limits: Limits | None) -> None:
        if not isinstance(value, list):
            refuse(where, f"must be a list of token ids, got {type_name(value)}")
        if self.non_empty and not value:
            refuse(where, "must not be empty")
        cap = limits.max_prompt_tokens if limits is not None else None
        if cap is not None and len(value) > cap:
            refuse(where, f"has {len(value)} ids, over {cap}", ErrorCode.PROMPT_TOO_LONG)
        vocab = limits.vocab_size if limits is not None and limits.vocab_size else None
        hi = (vocab - 1) if vocab else MAX_TOKEN_ID
        for i, t in enumerate(value):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= hi:
                bound = f"the vocabulary size {vocab}" if vocab else f"{MAX_TOKEN_ID + 1}"
                refuse(where, f"item {i} ({t!r:.40}) is not a msgpack integer >= 0 below {bound}")


@dataclass(frozen=True)
class AnyList(Rule):
    """A list whose items a cross-check looks at (chat turns, tools, stop strings)."""

    def check(self, where: str, value: Any, limits: Limits | None) -> None:
        if not isinstance(value, list):
            refuse(where, f"must be a list, got {type_name(value)}")


@dataclass(frozen=True)
class AnyMap(Rule):
    """A map whose contents a cross-check looks at (a schema, template switches)."""

    def check(self, where: str, value: Any, limits: Limits | None) -> None:
        if not isinstance(value, dict):
            refuse(where, f"must be a map, got {type_name(value)}")


@dataclass(frozen=True)
class AnyChoice(Rule):
    """A string or a map, told apart by a cross-check (tool_choice)."""

    def check(self, where: str, value: Any, limits: Limits | None) -> None:
        if not isinstance(value, (str, dict)):
            refuse(where, f"must be a string or a map, got {type_name(value)}")


@dataclass(frozen=True)
class Duration(Rule):
    """A keep-alive: seconds (a finite number) or a duration string (30s, 5m, -1)."""

    def check(self, where: str, value: Any, limits: Limits | None) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            refuse(where, f"must be seconds or a duration string, got {type_name(value)}")
        try:
            parse_keep_alive(value)
        except ValueError as exc:
            refuse(where, str(exc))
