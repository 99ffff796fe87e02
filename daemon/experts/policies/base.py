"""The interface every eviction policy implements (pure Python: the trace simulator runs it too)."""

from __future__ import annotations

import abc
from collections.abc import Collection, Iterable
from typing import ClassVar


class EvictionPolicy(abc.ABC):
    """Chooses which resident expert of one layer gives up its slot.

    The slot table (experts/slots.py) calls `begin_call` once per layer call (a forward pass
    through the layer, however many passes it needs), then `touch` for hits and `insert` for
    loads; `victim` and `remove` when a slot must be freed."""

    name: str = ""  # the registry key, e.g. "lru"
    # Values of the constructor's keyword parameters that `moed bench policy` fits on traces.
    PARAM_GRID: ClassVar[dict[str, tuple[float, ...]]] = {}

    def __init__(self, num_experts: int, slots: int):
        self.num_experts = num_experts
        self.slots = slots

    def begin_call(self) -> None:  # noqa: B027 - an optional hook, not an abstract method
        """A layer call starts (policies that age their statistics count these)."""

    def set_capacity(self, slots: int) -> None:
        """The cache was resized (called while it is empty, before the kept experts return)."""
        self.slots = slots

    @abc.abstractmethod
    def insert(self, expert: int) -> None:
        """`expert` was loaded into a slot."""

    @abc.abstractmethod
    def touch(self, expert: int) -> None:
        """A resident `expert` was used."""

    @abc.abstractmethod
    def remove(self, expert: int) -> None:
        """`expert` left the cache."""

    @abc.abstractmethod
    def victim(self, protected: Collection[int]) -> int:
        """A resident expert not in `protected` to evict."""

    def touch_many(self, experts: Iterable[int]) -> None:
        """`touch` each of `experts`, distinct ids, in order (policies with array state do it in
        one step)."""
        for e in experts:
            self.touch(int(e))

    def victims(self, count: int, protected: Iterable[int]) -> list[int]:
        """The next `count` victims outside `protected`, in the order `victim` would pick them
        while they are removed one by one (inserting protected experts never reorders them)."""
        chosen: list[int] = []
        excluded = {int(e) for e in protected}
        for _ in range(count):
            chosen.append(self.victim(excluded))
            excluded.add(chosen[-1])
        return chosen

    @abc.abstractmethod
    def order(self) -> list[int]:
        """Resident experts, most valuable last (used when the cache shrinks)."""


class AllProtectedError(RuntimeError):
    """Every resident expert is needed by the current pass: no slot can be freed."""
