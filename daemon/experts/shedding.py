"""Shrinking the expert cache under memory pressure (`shed`, from any thread: applied at the next
step's start, on the engine thread), and starting every pool over after a device failure."""

from __future__ import annotations

import logging
import threading

import mlx.core as mx

from moed.daemon.experts.host_route import HostRouting
from moed.daemon.experts.passes import PassLoads

log = logging.getLogger(__name__)


class Shedding:
    """The streamer's cache resizing, of the pools and the pass lane its passes hold."""

    def __init__(self, passes: PassLoads, routing: HostRouting, budget_bytes: int) -> None:
        self.passes, self.routing = passes, routing
        loads = passes.loads
        self.pools, self.fence, self.spec = loads.pools, loads.fence, loads.spec
        self.reader = loads.reader
        self.budget_bytes = budget_bytes
        self.pending: int | None = None  # a shed requested from another thread
        self.engine_thread = threading.get_ident()  # the loading thread until the first call
        self._lock = threading.Lock()

    def _resident_bytes(self) -> int:
        return sum(p.pool_bytes for p in self.pools)

    def shed(self, fraction: float) -> int:
        """Shrink the cache to `fraction` of its current size (at least one slot per layer).
        Returns the bytes released. From another thread the change is applied at the start of the
        next token, on the engine thread (the pools are MLX arrays)."""
        if not 0.0 <= fraction < 1.0:
            raise ValueError("shed fraction must be in [0, 1)")
        with self._lock:
            current = self.pending if self.pending is not None else min(p.slots for p in self.pools)
            target = max(1, int(current * fraction))
            released = sum(
                (p.slots - min(target, p.num_experts)) * p.expert_bytes
                for p in self.pools
                if p.slots > target
            )
            lane = self.passes.lane
            if lane is not None and lane.slots > target:  # narrowed with the pools
                released += (lane.slots - target) * (lane.nbytes // lane.slots)
            self.pending = target
        if self.engine_thread == threading.get_ident():
            self.apply()
        return released

    def apply(self) -> None:
        """The shed requested (`shed`), on the engine thread at a step's start."""
        self.spec.drain()
        self.fence.flush()  # resizing rewrites every slot
        with self._lock:
            target, self.pending = self.pending, None
        if target is None:
            return
        released = sum(p.resize(min(p.slots, target)) for p in self.pools)
        if self.passes.lane is not None:  # as wide as the pools again
            self.passes.renew_lane()
        self.routing.held = [False] * len(self.pools)  # re-checked (and re-sorted) at next call
        self.budget_bytes = self._resident_bytes()
        mx.clear_cache()  # hand the freed pool buffers back to the OS
        log.info("expert cache shed to %d slots per layer (%d bytes released)", target, released)

    def start_over(self, slots: int | None = None) -> int:
        """After a device failure inside a step: its pending outputs go unevaluated (they depend
        on the failed command buffer), reads in flight are given up and waited for, and every
        pool starts over empty, `slots` per layer (default: as now): the failed step may have
        claimed a slot whose bytes it never read. Returns the cache bytes released."""
        before = self._resident_bytes()
        self.fence.settled()
        self.spec.abandon()
        self.reader.quiesce()
        target = min(p.slots for p in self.pools) if slots is None else max(1, slots)
        with self._lock:
            self.pending = None
        for pool in self.pools:
            pool.start_over(min(target, pool.num_experts))
        self.passes.renew_lane()
        self.routing.reset()  # nothing held, the tally's sums may be poisoned
        self.budget_bytes = self._resident_bytes()
        return max(0, before - self.budget_bytes)
