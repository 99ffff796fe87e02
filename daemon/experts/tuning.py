"""Switches that pay on some machines and models and cost on others (next-layer prefetch, computing
resident experts during reads) are set by measurement on the running workload: the tuner probes
one switch at a time, a window of decode steps on and a window off, keeps the cheaper setting,
holds the result for a while, then probes again.

A step's cost is the time spent inside the streaming layers (router read-backs, stalls, planning,
graph building): what these switches change, with less of the noise of the rest of the step.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

WINDOW = 16  # decode steps per probe window
HOLD = 8  # windows to keep the chosen settings before probing again


@dataclass
class Switch:
    name: str
    active: bool = True
    # Extra condition for keeping it on (e.g. enough of the prefetch guesses were used).
    allowed: Callable[[], bool] = lambda: True
    net_ms: float | None = None  # step cost saved by having it on, in the last probe
    changes: int = 0


class StepTuner:
    def __init__(self, switches: list[Switch]):
        self.switches = switches
        self._plan: list[tuple[Switch, bool]] = []
        self._measured: dict[bool, float] = {}
        self._window: list[float] = []
        self._hold = 0
        self._start_probe()

    def _start_probe(self) -> None:
        self._plan = [(sw, setting) for sw in self.switches for setting in (True, False)]
        if self._plan:
            self._set(*self._plan[0])

    @staticmethod
    def _set(sw: Switch, active: bool) -> None:
        if sw.active != active:
            sw.changes += 1
        sw.active = active

    def on_step(self, cost_s: float) -> None:
        """One decode step spent `cost_s` in the streaming layers."""
        if not self.switches:
            return
        self._window.append(cost_s)
        if len(self._window) < WINDOW:
            return
        median = statistics.median(self._window)
        self._window = []
        if self._hold > 0:
            self._hold -= 1
            if self._hold == 0:
                self._start_probe()
            return
        sw, setting = self._plan.pop(0)
        self._measured[setting] = median
        if not setting:  # on and off both measured: decide this switch
            on, off = self._measured[True], self._measured[False]
            sw.net_ms = 1e3 * (off - on)
            self._set(sw, on < off and sw.allowed())
            log.debug("%s %s: net %.3f ms per step", sw.name, sw.active, sw.net_ms)
        if self._plan:
            self._set(*self._plan[0])
        else:
            self._hold = HOLD
