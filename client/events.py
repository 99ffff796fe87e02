"""Typed events of a generation stream, built from wire messages."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class TokenEvent:
    index: int
    ids: list[int]
    text: str
    # Per token of `ids` when the request asked for logprobs: {id, token, logprob, top: [...]}.
    logprobs: list[dict] | None = None


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


@dataclass(frozen=True)
class TraceEvent:
    """The next bytes of the request's router trace (concatenated in order they form the file)."""

    seq: int
    data: bytes


@dataclass(frozen=True)
class ProgressEvent:
    """The daemon is loading the model for this request (after an idle unload): how far along."""

    stage: str
    done: float
    total: float | None
    unit: str  # "bytes" or "steps"


Event = TokenEvent | TelemetryEvent | TraceEvent | ProgressEvent | DoneEvent
