"""Segmented LRU: a new expert enters a probation segment; a hit there promotes it to a protected
segment of `protected_share` of the slots (its least recent member falls back to probation).
Victims come from probation first, so experts used once cannot push out ones used again."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection

from moed.daemon.experts.policies.base import AllProtectedError, EvictionPolicy


class SLRUPolicy(EvictionPolicy):
    name = "slru"
    # Fitted by `moed bench policy` on the demo model's traces (held out per trace).
    DEFAULT_PROTECTED_SHARE = 0.625
    PARAM_GRID = {"protected_share": (0.25, 0.5, 0.625, 0.75, 0.875)}

    def __init__(self, num_experts: int = 0, slots: int = 0, protected_share: float | None = None):
        super().__init__(num_experts, slots)
        self.protected_share = (
            self.DEFAULT_PROTECTED_SHARE if protected_share is None else float(protected_share)
        )
        self._probation: OrderedDict[int, None] = OrderedDict()  # least recent first
        self._protected: OrderedDict[int, None] = OrderedDict()
        self.set_capacity(slots)

    def set_capacity(self, slots: int) -> None:
        super().set_capacity(slots)
        self._protected_cap = int(self.protected_share * slots)
        self._demote()

    def _demote(self) -> None:
        while len(self._protected) > self._protected_cap:
            expert, _ = self._protected.popitem(last=False)
            self._probation[expert] = None  # most recent end of probation

    def insert(self, expert: int) -> None:
        self._probation[expert] = None

    def touch(self, expert: int) -> None:
        if expert in self._protected:
            self._protected.move_to_end(expert)
            return
        self._probation.pop(expert, None)
        if self._protected_cap == 0:
            self._probation[expert] = None
            return
        self._protected[expert] = None
        self._demote()

    def remove(self, expert: int) -> None:
        self._probation.pop(expert, None)
        self._protected.pop(expert, None)

    def victim(self, protected: Collection[int]) -> int:
        for segment in (self._probation, self._protected):
            for expert in segment:
                if expert not in protected:
                    return expert
        raise AllProtectedError("every resident expert is protected; no slot can be freed")

    def order(self) -> list[int]:
        return [*self._probation, *self._protected]
