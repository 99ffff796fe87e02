"""The trust boundary: every field of every request checked for type and range, in one table.

A request is checked twice, both times here: `validate_request` on the raw map (types, ranges, the
loaded model's vocabulary and context when the daemon passes its `Limits`), and `check_context`
once the prompt is tokenized (non-empty, prompt plus `max_tokens` within the context). Nothing that
fails either reaches MLX. To add a field, add a row to FIELDS; to add a cross-field rule, append a
function to CROSS_CHECKS.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

from .chat import prompt_sources, validate_chat_fields
from .constraints import validate_constraint_fields, validate_template_kwargs
from .errors import ErrorCode, ProtocolError
from .messages import REQUEST_TYPES, Message, MessageType, PrefixCacheAction, ShedLevel
from .units import parse_keep_alive
from .version import PROTOCOL_MAJOR

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

    def describe(self) -> dict[str, Any]:
        return {
            "vocab_size": self.vocab_size,
            "context_tokens": self.context_tokens,
            "max_prompt_tokens": self.max_prompt_tokens,
            "max_tokens": self.max_tokens,
            "default_max_tokens": self.default_max_tokens,
            "telemetry_every": self.telemetry_every,
        }


def _refuse(where: str, message: str, code: ErrorCode = ErrorCode.INVALID_REQUEST) -> NoReturn:
    raise ProtocolError(code, f"{where}: {message}")


def _type_name(value: Any) -> str:
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
            _refuse(where, f"must be a msgpack integer, got {_type_name(value)} {value!r:.40}")
        hi = self.hi
        if limits is not None and self.hi_from is not None:
            hi = min(hi, self.hi_from(limits) or hi)
        if not self.lo <= value <= hi:
            _refuse(where, f"must be in [{self.lo}, {hi}], got {value}")


@dataclass(frozen=True)
class Number(Rule):
    lo: float = 0.0
    hi: float = math.inf
    lo_open: bool = False

    def check(self, where: str, value: Any, limits: Limits | None) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            _refuse(where, f"must be a number, got {_type_name(value)}")
        if not math.isfinite(value):
            _refuse(where, f"must be finite, got {value}")
        low_ok = value > self.lo if self.lo_open else value >= self.lo
        if not (low_ok and value <= self.hi):
            bracket = "(" if self.lo_open else "["
            _refuse(where, f"must be in {bracket}{self.lo:g}, {self.hi:g}], got {value}")


@dataclass(frozen=True)
class Str(Rule):
    max_chars: int = MAX_TEXT_CHARS
    non_empty: bool = False

    def check(self, where: str, value: Any, limits: Limits | None) -> None:
        if not isinstance(value, str):
            _refuse(where, f"must be a string, got {_type_name(value)}")
        if self.non_empty and not value:
            _refuse(where, "must not be empty")
        if len(value) > self.max_chars:
            code = ErrorCode.PROMPT_TOO_LONG if where.endswith("'prompt'") else None
            _refuse(
                where,
                f"is {len(value)} characters, over {self.max_chars}",
                code or ErrorCode.INVALID_REQUEST,
            )


@dataclass(frozen=True)
class Bool(Rule):
    def check(self, where: str, value: Any, limits: Limits | None) -> None:
        if not isinstance(value, bool):
            _refuse(where, f"must be true or false, got {_type_name(value)}")


@dataclass(frozen=True)
class OneOf(Rule):
    choices: type[enum.Enum] = ShedLevel

    def check(self, where: str, value: Any, limits: Limits | None) -> None:
        allowed = [c.value for c in self.choices]
        if value not in allowed:
            _refuse(where, f"must be one of {', '.join(allowed)}, got {value!r:.40}")


@dataclass(frozen=True)
class RequestId(Rule):
    def check(self, where: str, value: Any, limits: Limits | None) -> None:
        if isinstance(value, str):
            if len(value) > MAX_ID_CHARS:
                _refuse(where, f"is over {MAX_ID_CHARS} characters")
            return
        if isinstance(value, bool) or not isinstance(value, int):
            _refuse(where, f"must be a string or a msgpack integer, got {_type_name(value)}")
        if not -INT64_MAX <= value <= INT64_MAX:
            _refuse(where, "must fit in 64 bits")


@dataclass(frozen=True)
class TokenIds(Rule):
    non_empty: bool = False

    def check(self, where: str, value: Any, limits: Limits | None) -> None:
        if not isinstance(value, list):
            _refuse(where, f"must be a list of token ids, got {_type_name(value)}")
        if self.non_empty and not value:
            _refuse(where, "must not be empty")
        cap = limits.max_prompt_tokens if limits is not None else None
        if cap is not None and len(value) > cap:
            _refuse(where, f"has {len(value)} ids, over {cap}", ErrorCode.PROMPT_TOO_LONG)
        vocab = limits.vocab_size if limits is not None and limits.vocab_size else None
        hi = (vocab - 1) if vocab else MAX_TOKEN_ID
        for i, t in enumerate(value):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= hi:
                bound = f"the vocabulary size {vocab}" if vocab else f"{MAX_TOKEN_ID + 1}"
                _refuse(where, f"item {i} ({t!r:.40}) is not a msgpack integer >= 0 below {bound}")


@dataclass(frozen=True)
class AnyList(Rule):
    """A list whose items a cross-check looks at (chat turns, tools, stop strings)."""

    def check(self, where: str, value: Any, limits: Limits | None) -> None:
        if not isinstance(value, list):
            _refuse(where, f"must be a list, got {_type_name(value)}")


@dataclass(frozen=True)
class AnyMap(Rule):
    """A map whose contents a cross-check looks at (a schema, template switches)."""

    def check(self, where: str, value: Any, limits: Limits | None) -> None:
        if not isinstance(value, dict):
            _refuse(where, f"must be a map, got {_type_name(value)}")


@dataclass(frozen=True)
class AnyChoice(Rule):
    """A string or a map, told apart by a cross-check (tool_choice)."""

    def check(self, where: str, value: Any, limits: Limits | None) -> None:
        if not isinstance(value, (str, dict)):
            _refuse(where, f"must be a string or a map, got {_type_name(value)}")


@dataclass(frozen=True)
class Duration(Rule):
    """A keep-alive: seconds (a finite number) or a duration string (30s, 5m, -1)."""

    def check(self, where: str, value: Any, limits: Limits | None) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            _refuse(where, f"must be seconds or a duration string, got {_type_name(value)}")
        try:
            parse_keep_alive(value)
        except ValueError as exc:
            _refuse(where, str(exc))


GENERATE_FIELDS: dict[str, Rule] = {
    "prompt": Str(max_chars=4 * 1024 * 1024, non_empty=True),
    "prompt_ids": TokenIds(non_empty=True),
    "resume_ids": TokenIds(),
    "max_tokens": Int(lo=1),  # over limits.max_tokens: capped, and the `done` says so
    "temperature": Number(lo=0.0, hi=100.0),
    "top_p": Number(lo=0.0, hi=1.0, lo_open=True),
    "seed": Int(lo=0),
    "raw": Bool(),
    "model": Str(),
    "trace": Bool(),
    "progress": Bool(),  # `progress` messages while the prompt is read
    "telemetry_every": Int(lo=1, hi=2**31 - 1),
    "messages": AnyList(),  # chat turns; the daemon applies the model's chat template
    "tools": AnyList(),  # function specs for the chat template
    "stop": AnyList(),  # stop strings: the text ends before the first match
    "logprobs": Int(lo=0),  # per-token logprobs with this many top alternatives
    "keep_alive": Duration(),  # how long the model stays loaded after it
    # Constrained decoding and template switches (protocol/constraints.py checks their contents).
    "format": AnyMap(),  # structured output: {type: json | json_schema, schema}
    "tool_choice": AnyChoice(),  # auto | none | required | {name}
    "parallel_tool_calls": Bool(),  # false: at most one tool call
    "chat_template_kwargs": AnyMap(),  # e.g. {enable_thinking: false}
}

# Unknown fields are ignored (a newer client may send more); known ones must be right.
FIELDS: dict[MessageType, dict[str, Rule]] = {
    MessageType.HELLO: {"client": Str()},
    MessageType.GENERATE: GENERATE_FIELDS,
    MessageType.CANCEL: {"target": RequestId(required=True)},
    MessageType.STATUS: {},
    MessageType.STATS: {},
    MessageType.METRICS: {},
    MessageType.SHED: {"level": OneOf(choices=ShedLevel), "reason": Str(), "token": Str()},
    MessageType.SHUTDOWN: {"reason": Str(), "restart": Bool(), "token": Str()},
    MessageType.PING: {},
    MessageType.PREFIX_CACHE: {"action": OneOf(choices=PrefixCacheAction), "token": Str()},
    MessageType.COUNT_TOKENS: {
        "prompt": Str(max_chars=4 * 1024 * 1024),
        "messages": AnyList(),
        "tools": AnyList(),
        "raw": Bool(),
        "chat_template_kwargs": AnyMap(),
    },
}


def _one_prompt(msg: Message, limits: Limits | None) -> None:
    if len(prompt_sources(msg)) != 1:
        _refuse("generate", "give exactly one of 'prompt', 'prompt_ids' or 'messages'")
    validate_chat_fields(msg)


def _count_tokens_prompt(msg: Message, limits: Limits | None) -> None:
    if len(prompt_sources(msg)) != 1 or msg.get("prompt_ids") is not None:
        _refuse("count_tokens", "give exactly one of 'prompt' or 'messages'")
    validate_chat_fields(msg, "count_tokens")
    if msg.get("chat_template_kwargs") is not None:
        validate_template_kwargs(msg["chat_template_kwargs"])


def _prompt_chars(msg: Message, limits: Limits | None) -> None:
    # A cheap bound before tokenizing (count_tokens tokenizes on the transport thread): a token
    # is rarely more than 32 characters.
    if limits is None:
        return
    chars = len(msg.get("prompt") or "")
    if isinstance(msg.get("messages"), list):
        chars += sum(
            len(turn.get("content") or "")
            for turn in msg["messages"]
            if isinstance(turn, dict) and isinstance(turn.get("content"), str)
        )
    if chars > limits.max_prompt_tokens * 32:
        raise ProtocolError(
            ErrorCode.PROMPT_TOO_LONG,
            f"prompt of {chars} characters is over {limits.max_prompt_tokens} tokens",
        )


def _ids_within_context(msg: Message, limits: Limits | None) -> None:
    if limits is None or msg.get("prompt_ids") is None:
        return  # a text prompt is checked once tokenized (check_context)
    prompt = len(msg["prompt_ids"])
    max_tokens = resolve_max_tokens(msg.get("max_tokens"), prompt, limits)
    check_context(prompt, len(msg.get("resume_ids") or []), max_tokens, limits)


CROSS_CHECKS: dict[MessageType, list[Callable[[Message, Limits | None], None]]] = {
    MessageType.GENERATE: [
        _one_prompt,
        _prompt_chars,
        _ids_within_context,
        validate_constraint_fields,
    ],
    MessageType.COUNT_TOKENS: [_count_tokens_prompt, _prompt_chars],
}


def validate_request(msg: Any, limits: Limits | None = None) -> tuple[MessageType, Any]:
    """Check a decoded map against the schema; return its type and id or raise ProtocolError."""
    if not isinstance(msg, dict):
        raise ProtocolError(ErrorCode.BAD_FRAME, "a message must be a msgpack map")
    if msg.get("id") is not None:
        RequestId().check("'id'", msg["id"], limits)
    version = msg.get("v")
    if version is None:
        _refuse("'v'", "the protocol major version is required")
    if isinstance(version, float) and version == PROTOCOL_MAJOR:
        _refuse(
            "'v'", f"must be a msgpack integer; got the float {version!r}, send {PROTOCOL_MAJOR}"
        )
    Int(lo=0).check("'v'", version, limits)
    if version != PROTOCOL_MAJOR:
        raise ProtocolError(
            ErrorCode.UNSUPPORTED_VERSION,
            f"protocol version {version} is not supported; this daemon speaks {PROTOCOL_MAJOR}",
        )
    try:
        kind = MessageType(msg.get("type"))
    except ValueError:
        raise ProtocolError(
            ErrorCode.UNKNOWN_TYPE, f"unknown message type {msg.get('type')!r:.60}"
        ) from None
    if kind not in REQUEST_TYPES:
        raise ProtocolError(ErrorCode.UNKNOWN_TYPE, f"{kind.value!r} is not a request type")
    if msg.get("id") is None:
        _refuse("'id'", "is required")
    for name, rule in FIELDS[kind].items():
        value = msg.get(name)
        if value is None:
            if rule.required:
                _refuse(f"{kind.value}: field {name!r}", "is required")
            continue
        rule.check(f"{kind.value}: field {name!r}", value, limits)
    for check in CROSS_CHECKS.get(kind, ()):
        check(msg, limits)
    return kind, msg["id"]


def resolve_max_tokens(requested: int | None, prompt_tokens: int, limits: Limits) -> int:
    """The `max_tokens` a generation runs with: as asked (or the default), capped to the limit and
    to the context left after the prompt. The `done` of a capped request carries a notice."""
    room = (limits.context_tokens or math.inf) - prompt_tokens
    asked = limits.default_max_tokens if requested is None else requested
    return int(max(1, min(asked, limits.max_tokens, room)))


def check_context(prompt_tokens: int, resume_tokens: int, max_tokens: int, limits: Limits) -> None:
    """After tokenizing: a non-empty prompt within max_prompt_tokens that leaves the context room
    for one more token, and resumed tokens short of `max_tokens` (which counts them: a resume
    continues the same completion)."""
    if prompt_tokens < 1:
        _refuse("generate", "the prompt is empty after templating and tokenizing")
    total = prompt_tokens + resume_tokens
    if total > limits.max_prompt_tokens:
        raise ProtocolError(
            ErrorCode.PROMPT_TOO_LONG,
            f"prompt is {total} tokens; this daemon accepts at most {limits.max_prompt_tokens}",
        )
    context = limits.context_tokens
    if context is not None and total + 1 > context:
        raise ProtocolError(
            ErrorCode.PROMPT_TOO_LONG,
            f"prompt ({prompt_tokens} tokens) and resume_ids ({resume_tokens}) leave no room in "
            f"the model's context of {context} tokens",
        )
    if resume_tokens >= max_tokens:
        _refuse("generate", f"resume_ids ({resume_tokens}) already reach max_tokens ({max_tokens})")


def check_token_ids(ids: list[int], limits: Limits) -> None:
    """Ids a tokenizer produced must fit the embedding too (a tokenizer larger than the model)."""
    vocab = limits.vocab_size
    if vocab and ids and max(ids) >= vocab:
        _refuse(
            "generate", f"the prompt tokenizes to id {max(ids)}, outside the vocabulary ({vocab})"
        )
