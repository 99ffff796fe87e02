"""State the engine publishes for the transport thread to answer `status` without waiting on it.

Every field here reaches the `status` reply as it is named; protocol/PROTOCOL.md documents each.
"""

from __future__ import annotations

import dataclasses
import enum
import threading
import time
from dataclasses import dataclass, field
from typing import Any


class DaemonState(str, enum.Enum):
    LOADING = "loading"
    READY = "ready"
    IDLE = "idle"  # the keep-alive expired: model and expert cache released until the next request
    DRAINING = "draining"
    FAILED = "failed"
    # A device failure inside a step is being recovered in place: the interrupted rows are read
    # again; new requests wait (engine/recovery.py).
    RECOVERING = "recovering"
    STALLED = "stalled"  # set by the transport: work to do, no progress within the deadline


@dataclass(frozen=True)
class ShedRecord:
    """The last `shed` the engine carried out."""

    level: str
    at: float  # unix seconds
    released_bytes: int  # expert-cache bytes given back
    cancelled: Any  # the id of the request shed with `cancel_newest`, else None


@dataclass
class StatusRecord:
    """The engine's and transport's gauges and counters (the status reply's engine part)."""

    state: DaemonState = DaemonState.LOADING
    # Identity, published by the transport once it has bound its socket.
    pid: int | None = None
    boot_id: str | None = None
    socket: str | None = None
    version: str | None = None
    started_at: float = field(default_factory=time.time)
    # Load.
    model: dict[str, Any] | None = None
    load_s: float | None = None
    loads: int = 0  # model loads since the start (a recovery in place reloads nothing)
    memory_plan: str | None = None
    streaming: dict[str, Any] | None = None
    error: str | None = None
    load: dict[str, Any] | None = None  # while loading: {stage, done, total, unit}
    # Keep-alive (engine/idle.py): seconds an idle model stays loaded (-1 never), when the engine
    # last went idle, and how often the model was released.
    keep_alive_s: float | None = None
    last_activity_at: float | None = None
    unloads: int = 0
    # Requests and progress.
    active_requests: int = 0  # held by the engine: running or waiting for a batch row
    running_requests: int = 0  # in the running batch (prefilling or decoding)
    peak_running_requests: int = 0  # the most rows the batch has held since the start
    queued_requests: int = 0
    busy: bool = False
    last_token_at: float | None = None
    last_progress_at: float | None = None
    tokens_generated: int = 0
    requests_served: int = 0
    requests_failed: int = 0
    # Memory-pressure actions and crashes.
    sheds: int = 0
    last_shed: ShedRecord | None = None
    crashing: dict[str, Any] | None = None  # the crash record written while this run is failing
    # Device failures inside a step (engine/recovery.py): how they are met ("in_place", or why
    # the restart path), recoveries in place by kind, the last one (what failed, what was shed),
    # and the prompt chunk's ceiling a recovery set (None: none).
    device_recovery: str | None = None
    recoveries: dict[str, int] = field(default_factory=dict)
    last_recovery: dict[str, Any] | None = None
    prompt_chunk_limit: int | None = None
    # A pipeline group: every rank's host, layers, memory and expert cache (rank 0 first).
    ranks: list[dict[str, Any]] | None = None
    # The prefix KV cache's counters and tier sizes (engine/prefix_cache/), None when it is off;
    # its entries (most recently used first) for `moe cache list`.
    prefix_cache: dict[str, Any] | None = None
    prefix_entries: list[dict[str, Any]] | None = None
    # Grammar compiles (engine/row_grammars.py): {compiles, refused, cache_hits, timeouts,
    # workers}; None before the first grammar.
    grammars: dict[str, int] | None = None


_FIELDS = tuple(f.name for f in dataclasses.fields(StatusRecord))


def _wire(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):  # an instance
        return dataclasses.asdict(value)
    return value


class EngineStatus:
    """A StatusRecord behind a lock; the engine and transport write it, the transport reads it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._record = StatusRecord()

    def update(self, **values: Any) -> None:
        unknown = values.keys() - set(_FIELDS)
        if unknown:
            raise AttributeError(f"EngineStatus has no field {sorted(unknown)}")
        with self._lock:
            for name, value in values.items():
                setattr(self._record, name, value)

    def add(self, **deltas: int) -> None:
        unknown = deltas.keys() - set(_FIELDS)
        if unknown:
            raise AttributeError(f"EngineStatus has no field {sorted(unknown)}")
        with self._lock:
            for name, delta in deltas.items():
                setattr(self._record, name, getattr(self._record, name) + delta)

    def token_produced(self, at: float) -> None:
        # The per-token hot path: one lock round trip instead of two.
        with self._lock:
            self._record.tokens_generated += 1
            self._record.last_token_at = at

    def get(self, name: str) -> Any:
        with self._lock:
            return getattr(self._record, name)

    def snapshot(self) -> dict[str, Any]:
        """The record as wire values (enums as their strings, nested records as maps)."""
        with self._lock:
            return {name: _wire(getattr(self._record, name)) for name in _FIELDS}
