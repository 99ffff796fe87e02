"""Where the engine's events go: the transport's pipe in the daemon, a list in tests."""

from __future__ import annotations

from typing import Any, Protocol


class EventSink(Protocol):
    def emit(self, identity: bytes, msg: dict[str, Any], terminal: bool = False) -> None: ...
