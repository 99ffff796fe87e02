"""Making a layer call's experts resident: admission into the layer's slots (its policy picks
the victims), the reads of the missing ones queued (the store's jobs, the read pool) and waited
for, landed (landing.py) and counted, and the call's speculative reads caught up with. The
streamer (streamer.py) runs it on the engine thread."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from moed.daemon.experts.cache import LayerPool
from moed.daemon.experts.counters import Counters
from moed.daemon.experts.fence import LazyFence
from moed.daemon.experts.hooks import Watchers
from moed.daemon.experts.landing import Staging
from moed.daemon.experts.lookahead import Lookahead
from moed.daemon.experts.prefetch import ReadBatch, ReadPool, ReadResult
from moed.daemon.experts.speculation import Speculator
from moed.daemon.experts.store import ExpertStore
from moed.daemon.experts.tuning import Switch

# The streaming switch's decode graph: (layer input, the router's indices, the layer's pool); it
# looks the slots up in the pool's device table (cache.py) as it is evaluated.
DecodeGraph = Callable[[mx.array, mx.array, LayerPool], mx.array]

log = logging.getLogger(__name__)


@dataclass
class PendingLoad:
    """A layer call's admission whose reads are queued: `ready` experts can be computed now."""

    pool: LayerPool
    experts: np.ndarray
    hits: list[int]
    kept: set[int]  # hits that are speculative reads still landing
    loads: list[tuple[int, int]]
    demand: list[ReadBatch]
    spec_loads: list[tuple[int, int]]
    spec_batches: list[ReadBatch]
    stagings: list[Staging]  # where the demand reads land (landing.py); landed once collected
    spec_stagings: list[Staging]  # where the kept speculative reads land

    @property
    def ready(self) -> set[int]:
        """Resident and complete: not read by this load nor in flight."""
        return set(self.hits).difference(self.kept)


class SlotLoads:
    """The streamer's loads: a layer call's experts made resident in its pool, on the engine
    thread. It owns the speculative reads (speculation.py), which read through it."""

    def __init__(
        self,
        pools: list[LayerPool],
        counters: Counters,
        fence: LazyFence,
        reader: ReadPool,
        store: ExpertStore,
        watch: Watchers,
        overlap: Switch,
        routers: list[nn.Module | None],
        prefetch_next: bool,
        lookahead: bool = False,
    ):
        self.pools, self.counters, self.fence = pools, counters, fence
        self.reader, self.store, self.watch = reader, store, watch
        self.overlap = overlap  # resident rows computed during the reads (streaming_switch.py)
        self.spec = Speculator(self, routers, prefetch_next)
        # The next layer's guesses read into a lane while the disk idles (lookahead.py).
        self.lookahead = Lookahead(pools, reader, store, routers) if lookahead else None

    def load(self, layer: int, experts: np.ndarray) -> tuple[np.ndarray, dict[str, mx.array]]:
        """Make `experts` resident in `layer`; returns (expert -> slot table, pools)."""
        pending = self.begin_load(layer, experts)
        self.finish_load(pending)
        return self.table(pending.pool, experts), pending.pool.arrays

    def begin_load(self, layer: int, experts: np.ndarray) -> PendingLoad:
        """Admit `experts` and queue the reads of the missing ones without waiting for them."""
        pool = self.pools[layer]
        kept: set[int] = set()
        spec_batches: list[ReadBatch] = []
        spec_loads: list[tuple[int, int]] = []
        if self.spec.inflight(layer):
            kept, spec_batches, spec_loads = self.spec.settle(layer, set(experts.tolist()))
        hits, loads = self.admit_counted(layer, pool, experts)
        self.counters.prefetch_hits += len(kept)
        demand: list[ReadBatch] = []
        stagings: list[Staging] = []
        look = self.lookahead
        if loads:
            self.fence.guard(layer, loads)
            stagings.append(staging := pool.stage(loads))
            if look is None:
                demand.append(self.reader.submit(self.store.jobs_for(pool, staging)))
            elif (batch := look.serve(layer, pool, staging, experts.tolist())) is not None:
                demand.append(batch)  # the loads the lane holds are copied (lookahead.py)
        elif look is not None:
            look.issue(layer, experts.tolist())
        self.spec.issue(layer + 1)  # queued behind every demand read
        spec_stagings = self.spec.stagings_of(spec_loads)
        return PendingLoad(
            pool,
            experts,
            hits,
            kept,
            loads,
            demand,
            spec_loads,
            spec_batches,
            stagings,
            spec_stagings,
        )

    def admit_counted(
        self, layer: int, pool: LayerPool, experts: Iterable[int]
    ) -> tuple[list[int], list[tuple[int, int]]]:
        hits, loads = self._admit(pool, experts)
        lc = self.counters.layers[layer]
        lc.hits += len(hits)
        lc.misses += len(loads)
        observer = self.watch.observer
        if observer is not None:  # before the read: it asks whether the pages are cached
            observer.on_load(layer, pool, hits, loads)
        return hits, loads

    def finish_load(self, p: PendingLoad) -> None:
        """Wait for a `begin_load`'s reads: then every expert of it is in its slot."""
        if p.demand:
            self.collect(p.pool, p.loads, p.demand)
        landed = p.stagings
        if p.spec_batches and self._collect_speculative(
            p.pool, p.experts, p.spec_loads, p.spec_batches
        ):
            landed = landed + p.spec_stagings
        for staging in landed:
            p.pool.land(staging)

    @staticmethod
    def table(pool: LayerPool, experts: np.ndarray) -> np.ndarray:
        table = np.zeros(pool.num_experts, dtype=np.uint32)
        table[experts] = pool.slot_of[experts]
        return table

    def one_pass(
        self,
        layer: int,
        pool: LayerPool,
        ids: list[int],
        early: mx.array | None,
        build: tuple[DecodeGraph, mx.array, mx.array],
    ) -> mx.array | None:
        """A call whose experts fit one pass: its experts made resident and its output deferred,
        `early` where it was built before the ids were known, else built from `build` (the graph
        and its inputs) once they are resident. An all-hit call is a few list operations. None,
        with nothing done, where the general path runs (more ids than slots, speculative reads in
        flight for the layer, or some experts resident and some not while the overlapped path is
        on)."""
        if not 0 < len(ids) <= pool.slots or self.spec.inflight(layer):
            return None
        lookup = pool.slot_list.__getitem__
        slots = list(map(lookup, ids))
        lowest = min(slots)
        if lowest < 0 and self.overlap.active and max(slots) >= 0:
            return None  # rows to compute while the misses are read (streaming_switch.py)
        needed = sorted(set(ids))  # ascending, as the policy's call takes them
        spec, guarded = self.spec, not pool.staged  # a staged landing makes new arrays
        if lowest >= 0:  # every expert resident: no admission, no read
            pool.touch_call(needed)
            self.counters.layers[layer].hits += len(needed)
            observer = self.watch.observer
            if observer is not None:
                observer.on_load(layer, pool, needed, [])
            if spec.enabled:
                spec.issue(layer + 1)
            if self.lookahead is not None:
                self.lookahead.issue(layer, needed)
            out = early if early is not None else _build(build, pool)
            self.fence.defer(layer, out, slots if guarded else None)
            return out
        pool.begin_call()  # one pass: starts the call for the policy
        _hits, loads = self.admit_counted(layer, pool, needed)
        self.fence.guard(layer, loads)  # before this call's output exists: it is not pending
        staging = pool.stage(loads)
        look = self.lookahead
        if look is None:
            batches = [self.reader.submit(self.store.jobs_for(pool, staging))]
        else:  # the loads the lane holds are copied, the others read (lookahead.py)
            batch = look.serve(layer, pool, staging, needed)
            batches = [batch] if batch is not None else []
        if spec.enabled:
            spec.issue(layer + 1)  # queued behind the demand reads
        self.collect(pool, loads, batches)
        pool.land(staging)
        out = early if early is not None else _build(build, pool)
        self.fence.defer(layer, out, list(map(lookup, ids)) if guarded else None)
        return out

    def defer(self, layer: int, out: mx.array, slots_read: Iterable[int]) -> None:
        """`out` reads `slots_read` of `layer`'s pools and is not evaluated yet (fence.py)."""
        self.fence.defer(layer, out, None if self.pools[layer].staged else slots_read)

    def claim_slots(
        self, layer: int, experts: Iterable[int], keep: Sequence[int] = ()
    ) -> list[tuple[int, int]]:
        """Give `experts` (not resident) slots of `layer`'s pool for reads the caller issues, once
        the pending outputs that read those slots are evaluated, evicting none of `keep`; returns
        (expert, slot) loads."""
        _hits, loads = self._admit(self.pools[layer], experts, keep)
        self.fence.guard(layer, loads)
        return loads

    def collect(
        self, pool: LayerPool, loads: list[tuple[int, int]], batches: list[ReadBatch]
    ) -> None:
        try:
            res = self.reader.wait(batches)
        except BaseException:
            pool.forget(loads)
            raise
        self.count_reads(res)

    def _collect_speculative(
        self,
        pool: LayerPool,
        experts: np.ndarray,
        loads: list[tuple[int, int]],
        batches: list[ReadBatch],
    ) -> bool:
        """Wait for the speculative reads this call needs; a failed one is read again on demand
        (and reports its error then). False when they were read again (their staging is void)."""
        try:
            res = self.reader.wait(batches)
        except OSError as exc:
            log.warning("prefetch read failed, reading on demand: %s", exc)
            pool.forget(loads)
            _hits, again = self._admit(pool, experts)  # the whole pass stays protected
            self.fence.guard(pool.layer, again)
            staging = pool.stage(again)
            self.collect(pool, again, [self.reader.submit(self.store.jobs_for(pool, staging))])
            pool.land(staging)
            return False
        self.count_reads(res, prefetch=True)
        return True

    def _admit(
        self, pool: LayerPool, experts: Iterable[int], keep: Sequence[int] = ()
    ) -> tuple[list[int], list[tuple[int, int]]]:
        free_before = pool.free_slots
        hits, loads = pool.admit(experts, keep)
        self.counters.evictions += max(
            0, len(loads) - free_before
        )  # loads beyond free slots evicted
        return hits, loads

    def count_reads(self, res: ReadResult, prefetch: bool = False) -> None:
        """Account reads the engine waited for (demand misses, or speculative reads it caught up
        with)."""
        c = self.counters
        self.watch.progress()
        c.reads += res.jobs
        c.read_s += res.read_s
        c.stall_s += res.wall_s
        if prefetch:
            c.prefetch_bytes += res.bytes_read
        else:
            c.bytes_read += res.bytes_read


def _build(build: tuple[DecodeGraph, mx.array, mx.array], pool: LayerPool) -> mx.array:
    graph, x, indices = build
    return graph(x, indices, pool)
