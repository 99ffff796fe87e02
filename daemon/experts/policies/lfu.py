"""Least frequently used with exponential decay: each use adds 1 to an expert's score and scores
halve every `half_life` layer calls, so both how often and how lately an expert was used count.
Scores are kept for every expert, resident or not: an expert that was popular before its eviction
comes back with its history (routing popularity is stable over a generation)."""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable

import numpy as np

from moed.daemon.experts.policies.base import AllProtectedError, EvictionPolicy

_RESCALE_AT = 1e200  # weights grow as the clock runs; rescale long before float overflow


class LFUDecayPolicy(EvictionPolicy):
    name = "lfu"
    # Fitted by `moed bench policy` on the demo model's traces (held out per trace).
    DEFAULT_HALF_LIFE = 32.0  # held-out hit rates are flat from 16 to 48 on those traces
    PARAM_GRID = {"half_life": (4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 1024.0, math.inf)}

    def __init__(self, num_experts: int = 0, slots: int = 0, half_life: float | None = None):
        super().__init__(num_experts, slots)
        self.half_life = float(half_life or self.DEFAULT_HALF_LIFE)
        # A use at call t weighs growth**t: the same order as decaying every score each call.
        self._growth = 2.0 ** (1.0 / self.half_life) if math.isfinite(self.half_life) else 1.0
        self._weight = 1.0  # growth ** (calls so far), rescaled with the scores
        # Arrays over every expert, so a victim is one vectorized pick, not a Python scan.
        self._score = np.zeros(num_experts, dtype=np.float64)
        self._last = np.zeros(num_experts, dtype=np.int64)  # the call of the last use
        self._resident = np.zeros(num_experts, dtype=np.bool_)
        self._calls = 0

    def begin_call(self) -> None:
        self._calls += 1
        self._weight *= self._growth
        if self._weight > _RESCALE_AT:
            self._score *= 1.0 / self._weight
            self._weight = 1.0

    def _grow(self, expert: int) -> None:
        """A policy built without the expert count (simulators) grows as experts appear."""
        grow = expert + 1 - self._score.shape[0]
        self._score = np.concatenate([self._score, np.zeros(grow)])
        self._last = np.concatenate([self._last, np.zeros(grow, dtype=np.int64)])
        self._resident = np.concatenate([self._resident, np.zeros(grow, dtype=np.bool_)])

    def _use(self, expert: int) -> None:
        if expert >= self._score.shape[0]:
            self._grow(expert)
        self._score[expert] += self._weight
        self._last[expert] = self._calls

    def insert(self, expert: int) -> None:
        self._use(expert)
        self._resident[expert] = True

    def touch(self, expert: int) -> None:
        self._use(expert)

    def touch_many(self, experts: Iterable[int]) -> None:
        ids = np.asarray(experts, dtype=np.int64)
        if not ids.size:
            return
        if int(ids.max()) >= self._score.shape[0]:
            self._grow(int(ids.max()))
        self._score[ids] += self._weight  # distinct ids (the slot table's calls are)
        self._last[ids] = self._calls

    def remove(self, expert: int) -> None:
        if expert < self._resident.shape[0]:
            self._resident[expert] = False

    def _ranked(self, experts: np.ndarray) -> np.ndarray:
        """`experts` least valuable first: lowest score, then the older last use, then the id."""
        return experts[np.lexsort((self._last[experts], self._score[experts]))]

    def victim(self, protected: Collection[int]) -> int:
        return self.victims(1, protected)[0]

    def victims(self, count: int, protected: Iterable[int]) -> list[int]:
        """The `count` least valuable residents outside `protected`: one ranking for all of them
        (a victim's removal does not change the others' scores)."""
        candidates = self._resident.copy()
        if isinstance(protected, np.ndarray):
            wanted = protected.astype(np.int64, copy=False)
        else:
            wanted = np.fromiter(protected, dtype=np.int64)
        candidates[wanted[wanted < candidates.shape[0]]] = False
        idx = np.flatnonzero(candidates)
        if idx.size < count:
            raise AllProtectedError("every resident expert is protected; no slot can be freed")
        chosen: list[int] = self._ranked(idx)[:count].tolist()
        return chosen

    def order(self) -> list[int]:
        order: list[int] = self._ranked(np.flatnonzero(self._resident)).tolist()
        return order
