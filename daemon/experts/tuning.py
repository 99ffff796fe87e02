"""Switches that pay on some machines and models and cost on others (next-layer prefetch, computing
resident experts during reads) are set by measurement on the running workload: the tuner probes
one switch at a time, on and off in alternate decode steps (so both settings see the same load
from the rest of the machine), keeps the setting with the lower median step cost, holds the
result for a while, then probes again.

A step's cost is the time spent inside the streaming layers (router read-backs, stalls, planning,
graph building): what these switches change, with less of the noise of the rest of the step.
"""

from __future__ import annotations

import collections
import logging
import statistics
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

WINDOW = 16  # decode steps per setting in a probe (2 * WINDOW steps, alternating)
HOLD = 16  # windows of WINDOW steps to keep the chosen settings before probing again


@dataclass
class Switch:
    name: str
    active: bool = True
    # Extra condition for keeping it on (e.g. enough of the prefetch guesses were used).
    allowed: Callable[[], bool] = lambda: True
    net_ms: float | None = None  # step cost saved by having it on, in the last probe
    changes: int = 0


class RecentShare:
    """How much of what was guessed turned out used, over the last `window` samples."""

    def __init__(self, window: int) -> None:
        self._recent: collections.deque[tuple[int, int]] = collections.deque(maxlen=window)

    def add(self, used: int, guessed: int) -> None:
        if guessed:
            self._recent.append((used, guessed))

    @property
    def value(self) -> float | None:
        """None until something was guessed."""
        guessed = sum(g for _u, g in self._recent)
        return sum(u for u, _g in self._recent) / guessed if guessed else None


class StepTuner:
    def __init__(self, switches: list[Switch]):
        self.switches = switches
        self._queue: list[Switch] = []  # switches still to probe in this round
        self._costs: dict[bool, list[float]] = {True: [], False: []}
        self._held = 0  # steps held since the last round
        self._start_round()

    def remove(self, sw: Switch) -> None:
        """Never probe `sw` again (it stays as it is set)."""
        self.switches = [s for s in self.switches if s is not sw]
        self._queue = [s for s in self._queue if s is not sw]
        self._costs = {True: [], False: []}
        if self._queue:
            self._set(self._queue[0], True)

    def stop(self) -> None:
        """Every switch off and never probed again."""
        for sw in self.switches:
            self._set(sw, False)
        self.switches, self._queue = [], []
        self._costs = {True: [], False: []}

    def _start_round(self) -> None:
        self._queue = list(self.switches)
        self._costs = {True: [], False: []}
        if self._queue:
            self._set(self._queue[0], True)

    @staticmethod
    def _set(sw: Switch, active: bool) -> None:
        if sw.active != active:
            sw.changes += 1
        sw.active = active

    def on_step(self, cost_s: float) -> None:
        """One decode step spent `cost_s` in the streaming layers."""
        if not self._queue:  # holding
            self._held += 1
            if self._held >= HOLD * WINDOW:
                self._held = 0
                self._start_round()
            return
        sw = self._queue[0]
        self._costs[sw.active].append(cost_s)
        if min(len(c) for c in self._costs.values()) < WINDOW:
            self._set(sw, not sw.active)  # alternate
            return
        on, off = (statistics.median(self._costs[k]) for k in (True, False))
        sw.net_ms = 1e3 * (off - on)
        self._set(sw, on < off and sw.allowed())
        log.debug("%s %s: net %.3f ms per step", sw.name, sw.active, sw.net_ms)
        self._queue.pop(0)
        self._costs = {True: [], False: []}
        if self._queue:
            self._set(self._queue[0], True)
