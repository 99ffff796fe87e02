"""The engine's inbox: typed commands that the transport queues and the engine core handles.

Jobs and commands share one FIFO, so a Cancel always arrives after the Submit it names.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from moed.daemon.engine.grammar import GrammarConstraint
from moed.daemon.engine.request import GenerateJob, RequestKey
from moed.daemon.ground.crashlog import CrashKind
from moed.protocol import ErrorCode, ProtocolError, ShedLevel

# A grammar built for a waiting request: its constraint, its refusal, or none.
GrammarResult = GrammarConstraint | ProtocolError | None


@dataclass(frozen=True)
class Submit:
    """Start a validated `generate` request."""

    job: GenerateJob


@dataclass(frozen=True)
class Cancel:
    """End a request with `finish_reason: cancelled` (nothing happens if it already ended)."""

    key: RequestKey


@dataclass(frozen=True)
class Shed:
    """Give memory back: shrink the expert cache; `cancel_newest` also fails the newest request."""

    level: ShedLevel


@dataclass(frozen=True)
class ClearPrefixCache:
    """Empty the prefix KV cache, in memory and on the SSD."""


@dataclass(frozen=True)
class GrammarReady:
    """A waiting request's grammar was built on a grammar pool thread: its row's constraint, or
    the refusal that ends it (engine/grammar_pool.py)."""

    key: RequestKey
    result: GrammarResult  # None: it asked for no grammar after all


@dataclass(frozen=True)
class Stop:
    """Wake the engine thread so that it sees the stop flag and drains."""


@dataclass(frozen=True)
class Load:
    """Load the model now if it is not loaded (`moe load`, ollama's empty prompt)."""


@dataclass(frozen=True)
class Unload:
    """Release the model once it is idle (at once if it is); `done` is set when this engine has
    released it or will once its requests end (`moe unload`, room for another model)."""

    done: threading.Event = field(default_factory=threading.Event)


@dataclass(frozen=True)
class AwaitRoom:
    """Before the next load: wait until the models unloaded to make room for it have let go."""

    released: tuple[threading.Event, ...]
    timeout_s: float = 30.0


EngineCommand = (
    Submit | Cancel | Shed | ClearPrefixCache | GrammarReady | Stop | Load | Unload | AwaitRoom
)


def _nothing_queued(code: ErrorCode, message: str) -> None:
    """Driven in-process, nothing waits in an inbox."""


@dataclass(frozen=True)
class OwnerHooks:
    """What the engine core's owner (engine/loop.py) does for it; in-process, nothing."""

    # Records a crash durably before the in-flight requests are failed.
    on_crash: Callable[[CrashKind, str], None] | None = None
    # Fails the requests still waiting in the owner's inbox, before `fatal` is published.
    reject_queued: Callable[[ErrorCode, str], None] = _nothing_queued
    # A recovery in place, as it begins and once done (the watchdog and the crash record).
    on_recovery: Callable[[dict[str, Any]], None] | None = None
    # Commands from the core's own threads (grammar pool results) into the owner's inbox; None:
    # a queue that each step reads first.
    post: Callable[[EngineCommand], None] | None = None
