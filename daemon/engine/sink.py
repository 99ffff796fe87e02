"""Where the engine's events go: the transport's pipe in the daemon, a list in tests. The engine
hands over typed events (protocol/events.py); the sink encodes them (`to_wire`) where they leave."""

from __future__ import annotations

from typing import Protocol

from moed.protocol import EngineEvent
from moed.protocol.generate import RequestId


class EventSink(Protocol):
    def emit(self, identity: bytes, request_id: RequestId, event: EngineEvent) -> None:
        """One event of the request `request_id` of the client `identity`; a DoneEvent or a
        FailedEvent (TERMINAL_EVENTS) is its stream's last."""
        ...
