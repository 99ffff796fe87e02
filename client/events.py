"""Typed events of a generation stream: the protocol's own event classes (protocol/events.py),
read from the daemon's wire messages."""

from __future__ import annotations

from typing import Any

from moed.protocol.events import (
    DoneEvent,
    FailedEvent,
    LoadProgress,
    ProgressEvent,
    PromptProgress,
    TelemetryEvent,
    TokenEvent,
    TraceEvent,
    event_from_wire,
)

from .errors import RequestFailed

__all__ = [
    "DoneEvent",
    "Event",
    "LoadProgress",
    "ProgressEvent",
    "PromptProgress",
    "TelemetryEvent",
    "TokenEvent",
    "TraceEvent",
    "event_from_message",
]

# ProgressEvent: a model (re)load's (LoadProgress) or the prompt read so far (PromptProgress,
# stage `reading the prompt`, unit `tokens`); both carry stage, done, total and unit.
Event = TokenEvent | TelemetryEvent | TraceEvent | ProgressEvent | DoneEvent


def event_from_message(msg: dict[str, Any]) -> Event | None:
    """The event a generation-stream message carries; None for a type this client does not know
    (a newer daemon's). An `error` message raises RequestFailed."""
    event = event_from_wire(msg)
    if isinstance(event, FailedEvent):
        raise RequestFailed.from_event(event)
    return event
