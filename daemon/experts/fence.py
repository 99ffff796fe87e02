"""The lazy fence: streamed layers' outputs are built but not evaluated at once, so the device
runs ahead of the host. A slot one of them reads must not be overwritten before it ran: the fence
keeps, per layer, the slots its pending outputs read, and evaluates them when a load would land
on one (or at the next router read-back, which evaluates them anyway)."""

from __future__ import annotations

import time
from collections.abc import Iterable

import mlx.core as mx

from moed.daemon.experts.counters import Counters


class LazyFence:
    def __init__(self, counters: Counters):
        self.counters = counters
        self.outputs: list[mx.array] = []  # built, not evaluated yet
        # Per layer with pending outputs, the slots they read: only those layers are kept, so the
        # read-back's `settled` is one clear, not a walk over every layer.
        self._reads: dict[int, set[int]] = {}

    def defer(self, layer: int, out: mx.array, slots_read: Iterable[int] | None) -> None:
        """`out` reads `slots_read` of `layer`'s pool (ints; None: a staged pool, whose landing
        makes a new version instead of overwriting, so there is nothing to guard)."""
        self.outputs.append(out)
        if slots_read is not None:
            reads = self._reads.get(layer)
            if reads is None:
                self._reads[layer] = set(slots_read)  # a set: repeats are fine
            else:
                reads.update(slots_read)

    def guard(self, layer: int, loads: list[tuple[int, int]]) -> None:
        """Before `loads` ((expert, slot) pairs) land: evaluate the pending outputs if one of
        them reads a slot a load overwrites."""
        reads = self._reads.get(layer)
        if reads and any(slot in reads for _e, slot in loads):
            self.flush()

    def flush(self) -> None:
        """Evaluate every pending output now (a host sync of its own)."""
        if not self.outputs:
            return
        t0 = time.perf_counter()
        mx.eval(*self.outputs)
        self.settled()
        c = self.counters
        c.host_syncs += 1
        c.fences += 1
        c.expert_compute_s += time.perf_counter() - t0

    def settled(self) -> None:
        """The pending outputs were evaluated (by a flush, or by a read-back that took them)."""
        self.outputs = []
        self._reads.clear()
