"""Typed events of a generation stream, built from wire messages."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class TokenEvent:
    index: int
    ids: list[int]
    text: str


@dataclass(frozen=True)
class TelemetryEvent:
    data: dict[str, Any]


@dataclass(frozen=True)
class DoneEvent:
    finish_reason: str
    usage: dict[str, Any]
    timings: dict[str, Any]
    telemetry: dict[str, Any] = field(default_factory=dict)


Event = TokenEvent | TelemetryEvent | DoneEvent
