"""What the engine runs next: the scheduler owns the order of the active requests.

The engine core asks `schedule()` for the next round and carries it out; it holds no scheduling
logic of its own, so a batching scheduler replaces this one without touching the loop.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from moed.daemon.engine.request import RequestKey


@dataclass(frozen=True)
class Round:
    """One scheduling round: the requests to advance by one token each, in this order."""

    steps: tuple[RequestKey, ...]


class Scheduler(Protocol):
    def add(self, key: RequestKey) -> None:
        """A request was admitted."""

    def remove(self, key: RequestKey) -> None:
        """A request ended (finished, cancelled or failed); unknown keys are ignored."""

    def schedule(self) -> Round:
        """The next round of work; empty when nothing is active."""

    def newest(self) -> RequestKey | None:
        """The most recently admitted active request (shed first under memory pressure)."""

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[RequestKey]: ...


class RoundRobinScheduler:
    """Each active request advances one token per round, in admission order."""

    def __init__(self) -> None:
        self._order: dict[RequestKey, None] = {}  # insertion-ordered set

    def add(self, key: RequestKey) -> None:
        self._order[key] = None

    def remove(self, key: RequestKey) -> None:
        self._order.pop(key, None)

    def schedule(self) -> Round:
        return Round(tuple(self._order))

    def newest(self) -> RequestKey | None:
        return next(reversed(self._order), None)

    def __len__(self) -> int:
        return len(self._order)

    def __iter__(self) -> Iterator[RequestKey]:
        return iter(tuple(self._order))
