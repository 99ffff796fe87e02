"""The wire schema: message types and the builders of every message the daemon sends.

Every message is one msgpack map with `v` (protocol major), `type` and `id`. Requests are checked
in validation.py, in one place, so the daemon never trusts a peer's map; a `generate` is built
from its typed form (generate.py).
"""

from __future__ import annotations

import enum
from typing import Any

from .errors import RETRYABLE, ErrorCode, ProtocolError
from .version import PROTOCOL_MAJOR

# One wire message: a map with str keys (the codec refuses others), values as msgpack carries them.
Message = dict[str, Any]


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
    PREFIX_CACHE = "prefix_cache"  # list the prefix KV cache's entries, or clear it (owner)
    MODELS = "models"  # list the servable and loaded models, load one, unload one
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
        MessageType.PREFIX_CACHE,
        MessageType.MODELS,
    }
)
# Answered by the transport thread; never queued behind a generation.
CONTROL_TYPES = REQUEST_TYPES - {MessageType.GENERATE}


# Str enums: a client shows these as the text they are (str() and f-strings give the value).
class FinishReason(enum.StrEnum):
    STOP = "stop"  # end-of-sequence token
    LENGTH = "length"  # max_tokens reached
    CANCELLED = "cancelled"  # cancel request, or the client went away


class Channel(enum.StrEnum):
    """Which part of the model's turn a `token` message's text belongs to (the template's markers
    tell them apart; the markers themselves are in no channel)."""

    ANSWER = "answer"  # the reply (the default: a message without `channel` is the answer)
    REASONING = "reasoning"  # between the template's think markers (<think>...</think>)


class ShedLevel(str, enum.Enum):
    CACHE = "cache"  # shrink the expert cache and release MLX's buffer cache
    CANCEL_NEWEST = "cancel_newest"  # also cancel the most recently admitted request


class PrefixCacheAction(str, enum.Enum):
    LIST = "list"  # counters and entries, most recently used first
    CLEAR = "clear"  # empty both tiers (owner only)


class ModelsAction(str, enum.Enum):
    LIST = "list"  # every servable model (with its context) and the loaded ones (`moe ps`)
    LOAD = "load"  # load `model` now (room made as for a request)
    UNLOAD = "unload"  # release `model` once it is idle


def _base(kind: MessageType, request_id: Any) -> Message:
    return {"v": PROTOCOL_MAJOR, "type": kind.value, "id": request_id}


def error(request_id: Any, code: ErrorCode, message: str, **fields: Any) -> Message:
    return {
        **_base(MessageType.ERROR, request_id),
        "code": code.value,
        "message": message,
        "retryable": code in RETRYABLE,
        **fields,
    }


def refusal(request_id: Any, exc: ProtocolError) -> Message:
    """The `error` answering a refused request, with what the refusal carries (a `budget`)."""
    return error(request_id, exc.code, exc.message, **exc.wire_fields())


def result(request_id: Any, **body: Any) -> Message:
    return {**_base(MessageType.RESULT, request_id), **body}


def token(
    request_id: Any,
    index: int,
    ids: list[int],
    text: str,
    logprobs: list[dict[str, Any]] | None = None,
    tool_calls: list[dict[str, Any]] | None = None,
    channel: Channel | str = Channel.ANSWER,
) -> Message:
    msg = {**_base(MessageType.TOKEN, request_id), "index": index, "ids": ids, "text": text}
    if channel != Channel.ANSWER:
        msg["channel"] = str(channel)  # a StrEnum's str() is its value
    if logprobs is not None:
        msg["logprobs"] = logprobs
    if tool_calls:
        msg["tool_calls"] = tool_calls
    return msg


def trace_chunk(request_id: Any, seq: int, data: bytes) -> Message:
    """The next `data` bytes of the request's router trace file (chunks in `seq` order)."""
    return {**_base(MessageType.TRACE, request_id), "seq": seq, "data": data}


def progress(request_id: Any, stage: str, done: float, total: float | None, unit: str) -> Message:
    """Load progress for a generate that waits while the model (re)loads."""
    return {
        **_base(MessageType.PROGRESS, request_id),
        "stage": stage,
        "done": done,
        "total": total,
        "unit": unit,
    }


# The `progress` stage of a prompt being read (after every chunk, from 0 when the request joins the
# batch): a long prompt visibly moves before its first token.
PROMPT_STAGE = "reading the prompt"


def prompt_progress(request_id: Any, done: int, total: int) -> Message:
    """How many of the prompt's tokens (its context: prompt and resumed tokens) were read."""
    return progress(request_id, PROMPT_STAGE, done, total, "tokens")


def telemetry(request_id: Any, data: dict[str, Any]) -> Message:
    return {**_base(MessageType.TELEMETRY, request_id), "data": data}


def done(
    request_id: Any,
    finish_reason: FinishReason | str,
    usage: dict[str, Any],
    timings: dict[str, Any],
    telemetry: dict[str, Any] | None = None,
    stop_sequence: str | None = None,
    notice: str | None = None,
    lossy: dict[str, Any] | None = None,
) -> Message:
    msg = {
        **_base(MessageType.DONE, request_id),
        "finish_reason": str(finish_reason),
        "usage": usage,
        "timings": timings,
    }
    if telemetry is not None:
        msg["telemetry"] = telemetry
    if stop_sequence is not None:
        msg["stop_sequence"] = stop_sequence
    if notice:  # the daemon changed the request (a capped max_tokens)
        msg["notice"] = notice
    if lossy is not None:
        msg["lossy"] = lossy
    return msg


def welcome(request_id: Any, **body: Any) -> Message:
    return {**_base(MessageType.WELCOME, request_id), **body}


def request(kind: MessageType, request_id: Any, **fields: Any) -> Message:
    return {**_base(kind, request_id), **{k: v for k, v in fields.items() if v is not None}}


TERMINAL_TYPES = frozenset({MessageType.DONE, MessageType.ERROR})
