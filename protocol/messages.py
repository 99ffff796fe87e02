"""The wire schema: message types, their fields and validation.

Every message is one msgpack map with `v` (protocol major), `type` and `id`. Requests are checked
against FIELDS here, in one place, so the daemon never trusts a peer's map.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from .chat import prompt_sources, validate_chat_fields
from .errors import RETRYABLE, ErrorCode, ProtocolError
from .units import parse_keep_alive
from .version import PROTOCOL_MAJOR


class MessageType(str, enum.Enum):
    # client -> daemon
    HELLO = "hello"
    GENERATE = "generate"
    CANCEL = "cancel"
    STATUS = "status"
    STATS = "stats"
    METRICS = "metrics"
    SHED = "shed"
    SHUTDOWN = "shutdown"
    PING = "ping"
    COUNT_TOKENS = "count_tokens"  # prompt tokens of a prompt or messages, chat template applied
    # daemon -> client
    WELCOME = "welcome"
    TOKEN = "token"
    TELEMETRY = "telemetry"
    DONE = "done"
    ERROR = "error"
    RESULT = "result"
    TRACE = "trace"  # a chunk of a router trace (generate with trace: true)
    PROGRESS = "progress"  # the model is (re)loading for this generate: stage, done, total


REQUEST_TYPES = frozenset(
    {
        MessageType.HELLO,
        MessageType.GENERATE,
        MessageType.CANCEL,
        MessageType.STATUS,
        MessageType.STATS,
        MessageType.METRICS,
        MessageType.SHED,
        MessageType.SHUTDOWN,
        MessageType.PING,
        MessageType.COUNT_TOKENS,
    }
)
# Answered by the transport thread; never queued behind a generation.
CONTROL_TYPES = REQUEST_TYPES - {MessageType.GENERATE}


class FinishReason(str, enum.Enum):
    STOP = "stop"  # end-of-sequence token
    LENGTH = "length"  # max_tokens reached
    CANCELLED = "cancelled"  # cancel request, or the client went away


class ShedLevel(str, enum.Enum):
    CACHE = "cache"  # shrink the expert cache and release MLX's buffer cache
    CANCEL_NEWEST = "cancel_newest"  # also cancel the most recently admitted request


@dataclass(frozen=True)
class Field:
    types: tuple[type, ...]
    required: bool = False


_ID = (str, int)
_NUM = (int, float)

FIELDS: dict[MessageType, dict[str, Field]] = {
    MessageType.HELLO: {"client": Field((str,))},
    MessageType.GENERATE: {
        "prompt": Field((str,)),
        "prompt_ids": Field((list,)),
        "max_tokens": Field((int,)),
        "temperature": Field(_NUM),
        "top_p": Field(_NUM),
        "seed": Field((int,)),
        "raw": Field((bool,)),
        "model": Field((str,)),
        "resume_ids": Field((list,)),
        "trace": Field((bool,)),
        "telemetry_every": Field((int,)),
        "messages": Field((list,)),  # chat turns; the daemon applies the model's chat template
        "tools": Field((list,)),  # function specs for the chat template
        "stop": Field((list,)),  # stop strings: the text ends before the first match
        "logprobs": Field((int,)),  # per-token logprobs with this many top alternatives
        "keep_alive": Field((int, float, str)),  # how long the model stays loaded after it
    },
    MessageType.COUNT_TOKENS: {
        "prompt": Field((str,)),
        "messages": Field((list,)),
        "tools": Field((list,)),
        "raw": Field((bool,)),
    },
    MessageType.CANCEL: {"target": Field(_ID, required=True)},
    MessageType.STATUS: {},
    MessageType.STATS: {},
    MessageType.METRICS: {},
    MessageType.SHED: {"level": Field((str,)), "reason": Field((str,))},
    MessageType.SHUTDOWN: {"reason": Field((str,)), "restart": Field((bool,))},
    MessageType.PING: {},
}


def validate_request(msg: Any) -> tuple[MessageType, Any]:
    """Check a decoded map against the schema; return its type and id or raise ProtocolError."""
    if not isinstance(msg, dict):
        raise ProtocolError(ErrorCode.BAD_FRAME, "a message must be a msgpack map")
    request_id = msg.get("id")
    if request_id is not None and (isinstance(request_id, bool) or not isinstance(request_id, _ID)):
        raise ProtocolError(ErrorCode.INVALID_REQUEST, "'id' must be a string or an integer")
    version = msg.get("v")
    if isinstance(version, bool) or not isinstance(version, int):
        raise ProtocolError(ErrorCode.INVALID_REQUEST, "'v' (protocol major version) is required")
    if version != PROTOCOL_MAJOR:
        raise ProtocolError(
            ErrorCode.UNSUPPORTED_VERSION,
            f"protocol version {version} is not supported; this daemon speaks {PROTOCOL_MAJOR}",
        )
    try:
        kind = MessageType(msg.get("type"))
    except ValueError:
        raise ProtocolError(
            ErrorCode.UNKNOWN_TYPE, f"unknown message type {msg.get('type')!r}"
        ) from None
    if kind not in REQUEST_TYPES:
        raise ProtocolError(ErrorCode.UNKNOWN_TYPE, f"{kind.value!r} is not a request type")
    if request_id is None:
        raise ProtocolError(ErrorCode.INVALID_REQUEST, "'id' is required")
    for name, spec in FIELDS[kind].items():
        value = msg.get(name)
        if value is None:
            if spec.required:
                raise ProtocolError(
                    ErrorCode.INVALID_REQUEST, f"{kind.value}: field {name!r} is required"
                )
            continue
        if isinstance(value, bool) and bool not in spec.types:
            raise ProtocolError(
                ErrorCode.INVALID_REQUEST, f"{kind.value}: field {name!r} has the wrong type"
            )
        if not isinstance(value, spec.types):
            raise ProtocolError(
                ErrorCode.INVALID_REQUEST, f"{kind.value}: field {name!r} has the wrong type"
            )
    if kind is MessageType.GENERATE:
        _validate_generate(msg)
    if kind is MessageType.COUNT_TOKENS:
        if len(prompt_sources(msg)) != 1 or msg.get("prompt_ids") is not None:
            raise ProtocolError(
                ErrorCode.INVALID_REQUEST,
                "count_tokens: give exactly one of 'prompt' or 'messages'",
            )
        validate_chat_fields(msg, "count_tokens")
    if kind is MessageType.SHED and msg.get("level") is not None:
        try:
            ShedLevel(msg["level"])
        except ValueError:
            raise ProtocolError(
                ErrorCode.INVALID_REQUEST, f"shed: unknown level {msg['level']!r}"
            ) from None
    return kind, request_id


def _validate_generate(msg: dict) -> None:
    if len(prompt_sources(msg)) != 1:
        raise ProtocolError(
            ErrorCode.INVALID_REQUEST,
            "generate: give exactly one of 'prompt', 'prompt_ids' or 'messages'",
        )
    validate_chat_fields(msg)
    for name in ("prompt_ids", "resume_ids"):
        ids = msg.get(name)
        if ids is not None and not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids
        ):
            raise ProtocolError(
                ErrorCode.INVALID_REQUEST, f"generate: {name!r} must be a list of token ids"
            )
    if msg.get("prompt_ids") == []:
        raise ProtocolError(ErrorCode.INVALID_REQUEST, "generate: the prompt is empty")
    max_tokens = msg.get("max_tokens")
    if max_tokens is not None and max_tokens < 1:
        raise ProtocolError(ErrorCode.INVALID_REQUEST, "generate: 'max_tokens' must be at least 1")
    temperature = msg.get("temperature")
    if temperature is not None and temperature < 0:
        raise ProtocolError(ErrorCode.INVALID_REQUEST, "generate: 'temperature' must be >= 0")
    if msg.get("keep_alive") is not None:
        try:
            parse_keep_alive(msg["keep_alive"])
        except ValueError as exc:
            raise ProtocolError(ErrorCode.INVALID_REQUEST, f"generate: {exc}") from None
    top_p = msg.get("top_p")
    if top_p is not None and not 0 < top_p <= 1:
        raise ProtocolError(ErrorCode.INVALID_REQUEST, "generate: 'top_p' must be in (0, 1]")


def _base(kind: MessageType, request_id: Any) -> dict:
    return {"v": PROTOCOL_MAJOR, "type": kind.value, "id": request_id}


def error(request_id: Any, code: ErrorCode, message: str) -> dict:
    return {
        **_base(MessageType.ERROR, request_id),
        "code": code.value,
        "message": message,
        "retryable": code in RETRYABLE,
    }


def result(request_id: Any, **body: Any) -> dict:
    return {**_base(MessageType.RESULT, request_id), **body}


def token(
    request_id: Any,
    index: int,
    ids: list[int],
    text: str,
    logprobs: list[dict] | None = None,
    tool_calls: list[dict] | None = None,
) -> dict:
    msg = {**_base(MessageType.TOKEN, request_id), "index": index, "ids": ids, "text": text}
    if logprobs is not None:
        msg["logprobs"] = logprobs
    if tool_calls:
        msg["tool_calls"] = tool_calls
    return msg


def trace_chunk(request_id: Any, seq: int, data: bytes) -> dict:
    """The next `data` bytes of the request's router trace file (chunks in `seq` order)."""
    return {**_base(MessageType.TRACE, request_id), "seq": seq, "data": data}


def progress(request_id: Any, stage: str, done: float, total: float | None, unit: str) -> dict:
    """Load progress for a generate that waits while the model (re)loads."""
    return {
        **_base(MessageType.PROGRESS, request_id),
        "stage": stage,
        "done": done,
        "total": total,
        "unit": unit,
    }


def telemetry(request_id: Any, data: dict) -> dict:
    return {**_base(MessageType.TELEMETRY, request_id), "data": data}


def done(
    request_id: Any,
    finish_reason: FinishReason,
    usage: dict,
    timings: dict,
    telemetry: dict | None = None,
    stop_sequence: str | None = None,
) -> dict:
    msg = {
        **_base(MessageType.DONE, request_id),
        "finish_reason": finish_reason.value,
        "usage": usage,
        "timings": timings,
    }
    if telemetry is not None:
        msg["telemetry"] = telemetry
    if stop_sequence is not None:
        msg["stop_sequence"] = stop_sequence
    return msg


def welcome(request_id: Any, **body: Any) -> dict:
    return {**_base(MessageType.WELCOME, request_id), **body}


def request(kind: MessageType, request_id: Any, **fields: Any) -> dict:
    return {**_base(kind, request_id), **{k: v for k, v in fields.items() if v is not None}}


TERMINAL_TYPES = frozenset({MessageType.DONE, MessageType.ERROR})
