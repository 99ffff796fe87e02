"""Least recently used: the baseline."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection

from moed.daemon.experts.policies.base import AllProtectedError, EvictionPolicy


class LRUPolicy(EvictionPolicy):
    name = "lru"

    def __init__(self, num_experts: int = 0, slots: int = 0):
        super().__init__(num_experts, slots)
        self._order: OrderedDict[int, None] = OrderedDict()

    def insert(self, expert: int) -> None:
        self._order[expert] = None
        self._order.move_to_end(expert)

    def touch(self, expert: int) -> None:
        self._order.move_to_end(expert)

    def remove(self, expert: int) -> None:
        self._order.pop(expert, None)

    def victim(self, protected: Collection[int]) -> int:
        for expert in self._order:
            if expert not in protected:
                return expert
        raise AllProtectedError("every resident expert is protected; no slot can be freed")

    def order(self) -> list[int]:
        return list(self._order)
