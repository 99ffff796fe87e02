"""State the engine publishes for the transport thread to answer `status` without waiting on it."""

from __future__ import annotations

import enum
import threading
import time
from typing import Any


class DaemonState(str, enum.Enum):
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"
    FAILED = "failed"


class EngineStatus:
    """Thread-safe bag of gauges and counters; the engine writes, the transport reads snapshots."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, Any] = {
            "state": DaemonState.LOADING.value,
            "active_requests": 0,
            "queued_requests": 0,
            "busy": False,
            "last_token_at": None,
            "tokens_generated": 0,
            "requests_served": 0,
            "requests_failed": 0,
            "started_at": time.time(),
            "model": None,
            "streaming": None,
            "memory_plan": None,
            "error": None,
        }

    def update(self, **values: Any) -> None:
        with self._lock:
            self._values.update(values)

    def add(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._values[name] = self._values.get(name, 0) + delta

    def token_produced(self, at: float) -> None:
        # The per-token hot path: one lock round trip instead of two.
        with self._lock:
            self._values["tokens_generated"] += 1
            self._values["last_token_at"] = at

    def get(self, name: str) -> Any:
        with self._lock:
            return self._values.get(name)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return dict(self._values)
