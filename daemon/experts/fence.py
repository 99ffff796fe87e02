"""The lazy fence: streamed layers' outputs are built but not evaluated at once, so the device
runs ahead of the host. A slot one of them reads must not be overwritten before it ran: the fence
keeps, per slot array set (a layer's pool, or the pass lane: pass_lane.py), the slots its pending
outputs read, and evaluates those outputs when a load would land on one (or at the next router
read-back, which evaluates every pending output anyway)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import mlx.core as mx

from moed.daemon.experts.counters import Counters
from moed.daemon.ground.faults import SyncPoint


class LazyFence:
    def __init__(self, counters: Counters):
        self.counters = counters
        self.outputs: list[mx.array] = []  # built, not evaluated yet
        # Per slot array set with pending outputs (a layer's index, or the lane's key): the slots
        # they read and the outputs reading them; only such sets are kept, so the read-back's
        # `settled` is two clears, not a walk over every layer.
        self._reads: dict[int, set[int]] = {}
        self._readers: dict[int, list[mx.array]] = {}
        # Called after each evaluation: a device failure surfaces here (tests inject one).
        self.on_sync: Callable[[SyncPoint], None] | None = None

    def defer(self, key: int, out: mx.array, slots_read: Iterable[int] | None) -> None:
        """`out` reads `slots_read` of the slot arrays `key` names (ints; None: a staged pool,
        whose landing makes a new version instead of overwriting, so there is nothing to
        guard)."""
        self.outputs.append(out)
        if slots_read is not None:
            reads = self._reads.get(key)
            if reads is None:
                self._reads[key] = set(slots_read)  # a set: repeats are fine
                self._readers[key] = [out]
            else:
                reads.update(slots_read)
                self._readers[key].append(out)

    def guard(self, key: int, loads: list[tuple[int, int]]) -> None:
        """Before `loads` ((expert, slot) pairs) land in `key`'s arrays: evaluate the pending
        outputs that read them if one reads a slot a load overwrites. Only those: outputs
        submitted after them (another pass computing while this one's reads land) keep running."""
        reads = self._reads.get(key)
        if reads and any(slot in reads for _e, slot in loads):
            del self._reads[key]
            self._evaluate(self._readers.pop(key))

    def flush(self) -> None:
        """Evaluate every pending output now (a host sync of its own)."""
        if self.outputs:
            self._evaluate(self.outputs)
        self.settled()

    def _evaluate(self, outputs: list[mx.array]) -> None:
        t0 = time.perf_counter()
        mx.eval(*outputs)
        if self.on_sync is not None:
            self.on_sync(SyncPoint.FENCE)
        c = self.counters
        c.host_syncs += 1
        c.fences += 1
        c.expert_compute_s += time.perf_counter() - t0

    def settled(self) -> None:
        """The pending outputs were evaluated (by a flush, or by a read-back that took them), or
        are dropped unevaluated (a device failure: they depend on the failed command buffer)."""
        self.outputs = []
        self._reads.clear()
        self._readers.clear()
