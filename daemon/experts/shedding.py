"""Shrinking the expert cache under memory pressure (`shed`, from any thread: applied at the next
step's start, on the engine thread), and starting every pool over after a device failure."""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

import mlx.core as mx

from moed.daemon.experts.cache import LayerPool
from moed.daemon.experts.fence import LazyFence
from moed.daemon.experts.held import DeviceTally
from moed.daemon.experts.pass_lane import PassLane
from moed.daemon.experts.prefetch import ReadPool
from moed.daemon.experts.speculation import Speculator

log = logging.getLogger(__name__)


class Shedding:
    """The streamer's cache resizing (ExpertStreamer sets the state)."""

    # The streamer's state this mixin reads and sets (experts/streamer.py gives each a value).
    pools: list[LayerPool]
    lane: PassLane | None
    fence: LazyFence
    spec: Speculator
    reader: ReadPool
    tally: DeviceTally
    budget_bytes: int
    _held: list[bool]
    _step_tally: mx.array | None
    _pending_slots: int | None
    _engine_thread: int
    _lock: threading.Lock

    if TYPE_CHECKING:  # the streamer's own, called from here

        @property
        def slots(self) -> list[int]: ...

        @property
        def resident_bytes(self) -> int: ...

        def _make_lane(self) -> PassLane | None: ...

    def shed(self, fraction: float) -> int:
        """Shrink the cache to `fraction` of its current size (at least one slot per layer).
        Returns the bytes released. From another thread the change is applied at the start of the
        next token, on the engine thread (the pools are MLX arrays)."""
        if not 0.0 <= fraction < 1.0:
            raise ValueError("shed fraction must be in [0, 1)")
        with self._lock:
            current = self._pending_slots if self._pending_slots is not None else min(self.slots)
            target = max(1, int(current * fraction))
            released = sum(
                (p.slots - min(target, p.num_experts)) * p.expert_bytes
                for p in self.pools
                if p.slots > target
            )
            lane = self.lane
            if lane is not None and lane.slots > target:  # narrowed with the pools
                released += (lane.slots - target) * (lane.nbytes // lane.slots)
            self._pending_slots = target
        if self._engine_thread == threading.get_ident():
            self._apply_shed()
        return released

    def _apply_shed(self) -> None:
        self.spec.drain()
        self.fence.flush()  # resizing rewrites every slot
        with self._lock:
            target, self._pending_slots = self._pending_slots, None
        if target is None:
            return
        released = sum(p.resize(min(p.slots, target)) for p in self.pools)
        if self.lane is not None:  # as wide as the pools again
            self.lane = self._make_lane()
        self._held = [False] * len(self.pools)  # re-checked (and re-sorted) at their next call
        self.budget_bytes = self.resident_bytes
        mx.clear_cache()  # hand the freed pool buffers back to the OS
        log.info("expert cache shed to %d slots per layer (%d bytes released)", target, released)

    def start_over(self, slots: int | None = None) -> int:
        """After a device failure inside a step: its pending outputs go unevaluated (they depend
        on the failed command buffer), reads in flight are given up and waited for, and every
        pool starts over empty, `slots` per layer (default: as now): the failed step may have
        claimed a slot whose bytes it never read. Returns the cache bytes released."""
        before = self.resident_bytes
        self.fence.settled()
        self.spec.abandon()
        self.reader.quiesce()
        target = min(self.slots) if slots is None else max(1, slots)
        with self._lock:
            self._pending_slots = None
        for pool in self.pools:
            pool.start_over(min(target, pool.num_experts))
        self.lane = self._make_lane()
        self._held = [False] * len(self.pools)
        self.tally = DeviceTally([p.num_experts for p in self.pools])  # its sums may be poisoned
        self._step_tally = None
        self.budget_bytes = self.resident_bytes
        return max(0, before - self.resident_bytes)
