"""Typed events of a generation stream, built from wire messages."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from moed.protocol import MessageType

from .errors import RequestFailed


@dataclass(frozen=True)
class TokenEvent:
    index: int
    ids: list[int]
    text: str
    # Per token of `ids` when the request asked for logprobs: {id, token, logprob, top: [...]}.
    logprobs: list[dict] | None = None
    # Tool calls the model finished with this token: {id, name, arguments (a map)}.
    tool_calls: list[dict] | None = None
    # Which part of the turn the text is: "answer", or "reasoning" (between the think markers).
    channel: str = "answer"


@dataclass(frozen=True)
class TelemetryEvent:
    data: dict[str, Any]


@dataclass(frozen=True)
class DoneEvent:
    finish_reason: str
    usage: dict[str, Any]
    timings: dict[str, Any]
    telemetry: dict[str, Any] = field(default_factory=dict)
    stop_sequence: str | None = None  # the stop string that ended the text (finish_reason "stop")
    # K-reduction was on (lossy): {active_experts, native_experts, lossy}; None: native routing.
    lossy: dict[str, Any] | None = None


@dataclass(frozen=True)
class TraceEvent:
    """The next bytes of the request's router trace (concatenated in order they form the file)."""

    seq: int
    data: bytes


@dataclass(frozen=True)
class ProgressEvent:
    """How far the daemon is with this request before its first token: loading the model (after an
    idle unload), or reading the prompt (stage `reading the prompt`, unit `tokens`, per chunk)."""

    stage: str
    done: float
    total: float | None
    unit: str  # "bytes", "steps" or "tokens"


Event = TokenEvent | TelemetryEvent | TraceEvent | ProgressEvent | DoneEvent


def event_from_message(msg: dict) -> Event | None:
    """The event a generation-stream message carries; None for a type this client does not know
    (a newer daemon's). An `error` message raises RequestFailed."""
    kind = msg.get("type")
    if kind == MessageType.TOKEN.value:
        return TokenEvent(
            msg["index"],
            list(msg["ids"]),
            msg["text"],
            msg.get("logprobs"),
            msg.get("tool_calls"),
            msg.get("channel") or "answer",
        )
    if kind == MessageType.TELEMETRY.value:
        return TelemetryEvent(msg.get("data") or {})
    if kind == MessageType.PROGRESS.value:
        return ProgressEvent(
            str(msg.get("stage", "")),
            float(msg.get("done") or 0),
            msg.get("total"),
            str(msg.get("unit", "steps")),
        )
    if kind == MessageType.TRACE.value:
        return TraceEvent(int(msg.get("seq", 0)), bytes(msg.get("data") or b""))
    if kind == MessageType.DONE.value:
        return DoneEvent(
            msg["finish_reason"],
            msg.get("usage") or {},
            msg.get("timings") or {},
            msg.get("telemetry") or {},
            msg.get("stop_sequence"),
            msg.get("lossy"),
        )
    if kind == MessageType.ERROR.value:
        raise RequestFailed.from_message(msg)
    return None
