"""The engine's inbox: typed commands that the transport queues and the engine core handles.

Jobs and commands share one FIFO, so a Cancel always arrives after the Submit it names.
"""

from __future__ import annotations

from dataclasses import dataclass

from moed.daemon.engine.grammar import GrammarConstraint
from moed.daemon.engine.request import GenerateJob, RequestKey
from moed.protocol import ProtocolError, ShedLevel


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
    result: GrammarConstraint | ProtocolError | None  # None: it asked for no grammar after all


@dataclass(frozen=True)
class Stop:
    """Wake the engine thread so that it sees the stop flag and drains."""


EngineCommand = Submit | Cancel | Shed | ClearPrefixCache | GrammarReady | Stop
