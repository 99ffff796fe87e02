"""A host-routed layer call: the router's choices read back (the layer's one host sync), handed to
the concerns that watch routing, and, for a call whose experts fit one pass (the decode call),
its experts made resident and its output built.

This is the streamed layer's hot path, run once per MoE layer per token; its host time is what a
GPU idles through. So a decode call stays in Python lists end to end: right after the read-back's
eval each numpy or MLX call costs several times its warm cost (BENCHMARKS.md, issue 22 fourth
session; issue 36), and a call has eight ids. Only the general path (prompt chunks, passes) reads
the choices into numpy. The watching concerns cost one attribute test each when off.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import numpy as np

from moed.daemon.experts.cache import LayerPool
from moed.daemon.experts.counters import Counters
from moed.daemon.experts.fence import LazyFence
from moed.daemon.experts.hooks import Watchers
from moed.daemon.experts.prefetch import ReadBatch, ReadPool
from moed.daemon.experts.prompt_end import PromptEnd
from moed.daemon.experts.speculation import Speculator
from moed.daemon.experts.store import ExpertStore
from moed.daemon.experts.tuning import Switch
from moed.daemon.experts.unused_output import UnusedOutput
from moed.daemon.ground.faults import SyncPoint

# The streaming switch's decode graph: (layer input, the router's indices, the layer's pool); it
# looks the slots up in the pool's device table (cache.py) as it is evaluated.
DecodeGraph = Callable[[mx.array, mx.array, LayerPool], mx.array]
USAGE_FOLD = 256  # host-routed calls kept per layer before their ids are counted in `usage`


def flat_ids(indices: mx.array) -> list[int]:
    """An evaluated index array's values, flattened, as Python ints (`tolist`, then unnesting:
    cheaper than numpy on the few ids of a decode call)."""
    ids: Any = indices.tolist()
    for _ in range(indices.ndim - 1):
        ids = ids[0] if len(ids) == 1 else [e for part in ids for e in part]
    out: list[int] = ids
    return out


class HostRouting:
    """The streamer's routing read-back and one-pass calls (ExpertStreamer sets the state)."""

    # The streamer's state this mixin reads (experts/streamer.py gives each a value).
    counters: Counters
    fence: LazyFence
    spec: Speculator
    pools: list[LayerPool]
    reader: ReadPool
    store: ExpertStore
    overlap: Switch
    prompt_end: PromptEnd
    unused_output: UnusedOutput
    usage: list[np.ndarray]
    trace: list[list[np.ndarray]] | None
    watch: Watchers
    _routed: list[list[np.ndarray | list[int]]]
    _step_tally: mx.array | None

    if TYPE_CHECKING:  # the streamer's own methods, called from here

        def _fold_tally(self, evaluated: bool = False) -> None: ...

        def _read_ahead(self, layer: int) -> None: ...

        def _admit_counted(
            self, layer: int, pool: LayerPool, experts: Iterable[int]
        ) -> tuple[list[int], list[tuple[int, int]]]: ...

        def _collect(
            self, pool: LayerPool, loads: list[tuple[int, int]], batches: list[ReadBatch]
        ) -> None: ...

    def _read_back(self, layer: int, indices: mx.array, x: mx.array | None) -> float:
        """Evaluate the router's choices (the known cost centre, timed); returns when it ended."""
        c, fence, spec = self.counters, self.fence, self.spec
        tally, self._step_tally = self._step_tally, None
        predicted = spec.predict(layer, indices, x) if spec.enabled else None
        t0 = time.perf_counter()
        # The one host sync of the layer also finishes every pending layer output (usually
        # ancestors of these indices anyway), so their slots are free to be overwritten after it.
        if predicted is None and tally is None:  # the common call: nothing else to evaluate
            mx.eval(indices, *fence.outputs)
        else:
            mx.eval(indices, *[a for a in (predicted, tally) if a is not None], *fence.outputs)
        fence.settled()
        on_sync = self.watch.on_sync
        if on_sync is not None:  # a device failure surfaces at this read-back
            on_sync(SyncPoint.ROUTER)
        c.host_syncs += 1
        t1 = time.perf_counter()
        c.router_sync_s += t1 - t0
        if tally is not None:
            self._fold_tally(evaluated=True)
        if spec.enabled:
            spec.predicted(layer, predicted)
        return t1

    def route(self, layer: int, indices: mx.array, x: mx.array | None = None) -> np.ndarray:
        """Read the router's choices back to the host, as an array of `indices`' shape."""
        t1 = self._read_back(layer, indices, x)
        host = np.array(indices, dtype=np.intp)  # intp: numpy indexes with it without a cast
        self._routed_to(layer, host, host.shape, t1)
        return host

    def route_ids(self, layer: int, indices: mx.array, x: mx.array | None = None) -> list[int]:
        """`route` for a call of few ids (the decode call): its choices flattened, in a list."""
        t1 = self._read_back(layer, indices, x)
        ids = flat_ids(indices)
        self._routed_to(layer, ids, indices.shape, t1)
        return ids

    def _routed_to(
        self, layer: int, choices: np.ndarray | list[int], shape: Sequence[int], t1: float
    ) -> None:
        """Hand a layer call's choices to the concerns that watch routing."""
        c = self.counters
        if self.prompt_end.active:
            c.prompt_end_hits += self.prompt_end.record(layer, choices)
        elif len(shape) >= 3 and shape[-2] > 1:  # a prompt chunk
            # Its read-back settled the layer before: that pool is free until the next step.
            if layer > 0:
                self._read_ahead(layer - 1)
            elif self.unused_output.active:  # the chunk skips the last layer: idle all along
                self._read_ahead(len(self.pools) - 1)
        routed = self._routed[layer]
        routed.append(choices)  # folded into `usage` in bulk (_fold_usage)
        if len(routed) >= USAGE_FOLD:
            self._fold_usage(layer)
        if self.trace is not None:
            if layer == 0:
                self.trace.append([])
            if self.trace:
                self.trace[-1].append(np.unique(np.asarray(choices, dtype=np.intp)))
        c.layer_calls += 1
        c.router_copy_s += time.perf_counter() - t1
        watch = self.watch
        if watch.observer is not None:
            watch.observer.on_route(layer, np.asarray(choices, dtype=np.intp).reshape(shape))
        watch.progress()

    def _fold_usage(self, layer: int) -> None:
        routed, self._routed[layer] = self._routed[layer], []
        if routed:
            u = self.usage[layer]
            flat = np.concatenate([np.ravel(r) for r in routed])
            u += np.bincount(flat, minlength=u.shape[0])[: u.shape[0]]

    def decode_call(
        self, layer: int, indices: mx.array, x: mx.array, graph: DecodeGraph
    ) -> tuple[mx.array | None, list[int]]:
        """A call of few ids (the decode call): its choices read back (`route_ids`) and, where
        they fit one pass, its experts made resident and its output, `graph(x, indices, pool)`,
        deferred; returns (that output, or None where the general path runs, and the ids). The
        graph looks each id's slot up on the device, in a table written as experts get slots, so
        for a DIRECT pool it is built before the read-back (it needs no ids from the host, and
        built while the host's caches are warm it costs a fraction of what it costs after the
        eval). A staged pool's landing makes new arrays: there it is built once the call's
        experts are resident (built early, a call with misses would build it twice)."""
        pool = self.pools[layer]
        early = None
        if not pool.staged and indices.size <= pool.slots and not self.spec.inflight(layer):
            early = graph(x, indices, pool)
        ids = self.route_ids(layer, indices, x)
        if early is None and not pool.staged:
            return None, ids
        return self._one_pass(layer, pool, ids, early, (graph, x, indices)), ids

    def _one_pass(
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
            out = early if early is not None else _build(build, pool)
            self.fence.defer(layer, out, slots if guarded else None)
            return out
        pool.begin_call()  # one pass: starts the call for the policy
        _hits, loads = self._admit_counted(layer, pool, needed)
        self.fence.guard(layer, loads)  # before this call's output exists: it is not pending
        staging = pool.stage(loads)
        batch = self.reader.submit(self.store.jobs_for(pool, staging))
        if spec.enabled:
            spec.issue(layer + 1)  # queued behind the demand reads
        self._collect(pool, loads, [batch])
        pool.land(staging)
        out = early if early is not None else _build(build, pool)
        self.fence.defer(layer, out, list(map(lookup, ids)) if guarded else None)
        return out


def _build(build: tuple[DecodeGraph, mx.array, mx.array], pool: LayerPool) -> mx.array:
    graph, x, indices = build
    return graph(x, indices, pool)
