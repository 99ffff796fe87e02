"""Least frequently used with exponential decay: each use adds 1 to an expert's score and scores
halve every `half_life` layer calls, so both how often and how lately an expert was used count.
Scores are kept for every expert, resident or not: an expert that was popular before its eviction
comes back with its history (routing popularity is stable over a generation)."""

from __future__ import annotations

import heapq
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
        # Python lists and a set, not numpy arrays: a layer call touches a handful of experts and
        # ranks a few dozen residents, where each numpy call costs more than the loop it replaces
        # (the streamed decode path's host time, BENCHMARKS.md). Floats add as numpy's do.
        self._score = [0.0] * num_experts
        self._last = [0] * num_experts  # the call of the last use
        self._resident: set[int] = set()
        self._calls = 0
        # Victims by their key (score, last use, id), lowest first: an entry per use, pushed as it
        # happens, so choosing a victim pops a few entries instead of ranking every resident on
        # the streamed layer call's path. An entry is stale once its expert was used again or
        # left (its key is no longer the expert's); stale entries are skipped, and dropped when
        # they pile up.
        self._heap: list[tuple[float, int, int]] = []

    def begin_call(self) -> None:
        self._calls += 1
        self._weight *= self._growth
        if self._weight > _RESCALE_AT:
            scale = 1.0 / self._weight
            self._score = [v * scale for v in self._score]
            self._weight = 1.0
            self._rebuild()  # every key changed

    def _grow(self, expert: int) -> None:
        """A policy built without the expert count (simulators) grows as experts appear."""
        grow = expert + 1 - len(self._score)
        self._score += [0.0] * grow
        self._last += [0] * grow

    def _use(self, expert: int) -> None:
        if expert >= len(self._score):
            self._grow(expert)
        score = self._score[expert] = self._score[expert] + self._weight
        self._last[expert] = self._calls
        heapq.heappush(self._heap, (score, self._calls, expert))

    def insert(self, expert: int) -> None:
        self._use(expert)
        self._resident.add(expert)

    def touch(self, expert: int) -> None:
        self._use(expert)

    def touch_many(self, experts: Iterable[int]) -> None:
        ids = experts.tolist() if isinstance(experts, np.ndarray) else list(experts)
        if ids and max(ids) >= len(self._score):  # a policy built without the expert count
            self._grow(max(ids))
        score, last, weight, now = self._score, self._last, self._weight, self._calls
        heap, push = self._heap, heapq.heappush
        for e in ids:
            s = score[e] = score[e] + weight
            last[e] = now
            push(heap, (s, now, e))
        if len(heap) > 4 * len(self._resident) + 256:
            self._rebuild()

    def remove(self, expert: int) -> None:
        self._resident.discard(expert)

    def _key(self, expert: int) -> tuple[float, int, int]:
        """Least valuable first: lowest score, then the older last use, then the id."""
        return self._score[expert], self._last[expert], expert

    def victim(self, protected: Collection[int]) -> int:
        return self.victims(1, protected)[0]

    def victims(self, count: int, protected: Iterable[int]) -> list[int]:
        """The `count` least valuable residents outside `protected` (lowest key first): one
        ranking for all of them (a victim's removal does not change the others' keys)."""
        excluded = set(protected.tolist() if isinstance(protected, np.ndarray) else protected)
        score, last, resident, heap = self._score, self._last, self._resident, self._heap
        chosen: list[tuple[float, int, int]] = []
        kept: list[tuple[float, int, int]] = []  # current entries of protected experts
        while len(chosen) < count:
            if not heap:
                for entry in chosen + kept:
                    heapq.heappush(heap, entry)
                raise AllProtectedError("every resident expert is protected; no slot can be freed")
            entry = heapq.heappop(heap)
            s, used, e = entry
            if e not in resident or score[e] != s or last[e] != used:
                continue  # stale: used again since, or gone
            (kept if e in excluded else chosen).append(entry)
        for entry in chosen + kept:  # still resident until the caller removes them
            heapq.heappush(heap, entry)
        return [e for _s, _used, e in chosen]

    def _rebuild(self) -> None:
        """The heap of the residents' current keys only."""
        score, last = self._score, self._last
        self._heap = [(score[e], last[e], e) for e in self._resident]
        heapq.heapify(self._heap)

    def order(self) -> list[int]:
        return sorted(self._resident, key=self._key)
