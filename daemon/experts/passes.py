"""A call whose distinct experts outnumber its layer's slots runs in passes (multi_pass.py
`rows_by_pass`): each pass's experts made resident in turn, in the layer's pool or, where it
fits, alternating with the pass lane (pass_lane.py) so a pass's reads land while the one before
computes."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from moed.daemon.experts.landing import Staging
from moed.daemon.experts.loads import PendingLoad, SlotLoads
from moed.daemon.experts.pass_lane import LANE, PassLane, lane_loads
from moed.daemon.experts.prefetch import ReadBatch


@dataclass(frozen=True)
class LoadedPass:
    """One pass of a multi-pass call, its experts resident in `arrays` (a layer's pool, or the
    pass lane) at `table[expert]`."""

    experts: np.ndarray
    table: np.ndarray
    arrays: dict[str, mx.array]
    key: int  # the fence's key of `arrays`: the layer, or LANE
    pipelined: bool  # the next pass's reads land while this one computes (submit_pass)


@dataclass(frozen=True)
class _LaneRead:
    """A lane pass whose reads are queued."""

    experts: np.ndarray
    batch: ReadBatch


class PassLoads:
    """The streamer's passes, through its loads, and the pass lane they may alternate with."""

    def __init__(self, loads: SlotLoads) -> None:
        self.loads = loads
        self.pools, self.counters, self.fence = loads.pools, loads.counters, loads.fence
        self.reader, self.store, self.watch = loads.reader, loads.store, loads.watch
        self.lane = self._make_lane()

    def plan_passes(self, layer: int, needed: np.ndarray) -> list[np.ndarray]:
        """`needed`: the call's distinct experts, ascending (np.unique of its indices)."""
        passes = self.pools[layer].plan_passes(needed)
        self.counters.passes += len(passes) - 1
        return passes

    def load_passes(self, layer: int, passes: list[np.ndarray]) -> Iterator[LoadedPass]:
        """Each pass's experts made resident, in turn. Where the pass lane fits the layer, passes
        alternate between the pool and the lane: the first two passes' reads are issued at once,
        each later pass's once the caller has submitted the pass before it (`submit_pass`), so
        they land while it computes (pass_lane.py). Otherwise each pass is loaded into the pool
        after the one before."""
        pool, lane, loads = self.pools[layer], self.lane, self.loads
        if lane is None or len(passes) < 2 or not lane.fits(pool):
            for experts in passes:
                table, arrays = self.loads.load(layer, experts)
                yield LoadedPass(experts, table, arrays, layer, False)
            return
        # The lane is free as the call starts (the read-back settled every output): pass 1's
        # reads go out with pass 0's, before pass 0 is built.
        pending: list[PendingLoad | _LaneRead] = [
            loads.begin_load(layer, passes[0]),
            self._begin_lane(layer, lane, passes[1]),
        ]
        for i in range(len(passes)):
            p = pending[i]
            if isinstance(p, _LaneRead):
                loads.count_reads(self.reader.wait([p.batch]))
                table = np.zeros(pool.num_experts, dtype=np.uint32)
                table[p.experts] = np.arange(p.experts.size, dtype=np.uint32)
                yield LoadedPass(p.experts, table, lane.arrays, LANE, True)
            else:
                loads.finish_load(p)
                yield LoadedPass(p.experts, loads.table(pool, p.experts), pool.arrays, layer, True)
            if 0 < i < len(passes) - 1:  # odd passes in the lane, even ones in the pool
                nxt = passes[i + 1]
                pending.append(
                    self._begin_lane(layer, lane, nxt)
                    if i % 2 == 0
                    else loads.begin_load(layer, nxt)
                )

    def _begin_lane(self, layer: int, lane: PassLane, experts: np.ndarray) -> _LaneRead:
        """Queue the reads of a lane pass (none of its experts is in the pool: passes put the
        resident ones first, and the pool's passes admit only their own)."""
        pool = self.pools[layer]
        loads = lane_loads(experts.tolist())
        self.counters.layers[layer].misses += len(loads)
        self.counters.lane_loads += len(loads)
        observer = self.watch.observer
        if observer is not None:
            observer.on_load(layer, pool, [], loads)
        self.fence.guard(LANE, loads)  # the lane's pass before this one has run
        staging = Staging(loads)
        return _LaneRead(
            experts, self.reader.submit(self.store.jobs_for(lane.target(pool), staging))
        )

    def submit_pass(
        self, layer: int, done: LoadedPass, out: mx.array, slots_read: list[int]
    ) -> None:
        """`out`, computed from `done`'s arrays, is deferred behind the fence (and submitted to
        the device now when the next pass's reads are to land while it runs)."""
        if done.key == LANE:
            self.fence.defer(LANE, out, slots_read)
        else:
            self.loads.defer(layer, out, slots_read)
        if done.pipelined:
            mx.async_eval(out)

    def lane_layers(self) -> list[bool]:
        """Per layer, whether its multi-pass calls alternate with the pass lane (load_passes)."""
        lane = self.lane
        return [lane is not None and lane.fits(p) for p in self.pools]

    def drop_lane(self) -> None:
        """Multi-pass calls run in the layer's pool alone (benches and tests compare)."""
        self.lane = None

    def renew_lane(self) -> None:
        """After the pools were resized or started over: the lane as wide as they are now."""
        self.lane = self._make_lane()

    def _make_lane(self) -> PassLane | None:
        """The pass lane (pass_lane.py) as wide as the widest DIRECT pool that cannot hold its
        layer's experts; None where no layer needs passes."""
        partial = [p for p in self.pools if p.slots < p.num_experts and not p.staged]
        return PassLane(max(partial, key=lambda p: p.pool_bytes)) if partial else None
