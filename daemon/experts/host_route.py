"""The streamer's routing: each layer call routed on the device (a held layer) or read back to the
host (the layer's one host sync), the choices handed to the concerns that watch routing and
tallied; a call whose experts fit one pass (the decode call) then goes to the loads (loads.py).

This is the streamed layer's hot path, run once per MoE layer per token; its host time is what a
GPU idles through. So a decode call stays in Python lists end to end: right after the read-back's
eval each numpy or MLX call costs several times its warm cost (BENCHMARKS.md, issue 22 fourth
session; issue 36), and a call has eight ids. Only the general path (prompt chunks, passes) reads
the choices into numpy. The watching concerns cost one attribute test each when off.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
import numpy as np

from moed.daemon.experts.held import DeviceTally
from moed.daemon.experts.loads import DecodeGraph, SlotLoads
from moed.daemon.experts.prompt_end import PromptEnd
from moed.daemon.experts.unused_output import UnusedOutput
from moed.daemon.ground.faults import SyncPoint

log = logging.getLogger(__name__)

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
    """The streamer's routing: where each layer call routes (on the device where its layer holds
    every expert, held.py; else read back to the host), the concerns that watch the choices, and
    their tallies (usage, the held layers' device tally)."""

    def __init__(self, loads: SlotLoads, bypass_page_cache: bool) -> None:
        self.loads, self.spec, self.watch = loads, loads.spec, loads.watch
        self.lookahead = loads.lookahead  # the next layer's guess, evaluated with the read-back
        self.pools, self.counters, self.fence = loads.pools, loads.counters, loads.fence
        # Prompt-end reads ahead only where reads wait on the SSD (prompt_end.py).
        self.bypass_page_cache = bypass_page_cache
        layers, experts = len(self.pools), [p.num_experts for p in self.pools]
        self.usage = [np.zeros(n, dtype=np.int64) for n in experts]  # host-routed
        # Host-routed choices (each call's ids) not yet folded into `usage`: a list append per
        # call, one bincount per layer when usage is asked for (or the list grows long).
        self._routed: list[list[np.ndarray | list[int]]] = [[] for _ in range(layers)]
        # Layers whose every expert is held route on the device (held.py); their usage is here.
        self.held = [False] * layers
        self.tally = DeviceTally(experts)
        self._step_tally: mx.array | None = None  # evaluated with the step's first MoE layer
        self.trace: list[list[np.ndarray]] | None = None  # routing recorded (record_routing)
        # False: every layer is read back to the host even when it holds every expert (bench).
        self.device_routing = True
        self.unused_output = UnusedOutput()  # the engine's prompt chunks (unused_output.py)
        self.prompt_end = PromptEnd(layers)  # a prompt's last token (prompt_end.py)

    def record_routing(self, trace: bool = True, device_routing: bool = True) -> None:
        """For benches and tests: `trace` records from now on each forward pass's distinct
        experts per layer (in `trace`; every layer routed on the host); `device_routing` False
        reads a layer back to the host even where it holds every expert."""
        self.trace = [] if trace else None
        self.device_routing = device_routing

    def step_started(self) -> None:
        """A forward step starts: the held layers' tally of the step before is taken with it."""
        self._step_tally = self.tally.step()

    def reset(self) -> None:
        """Every pool started over (shedding.py): no layer is held, the tally starts again."""
        self.held = [False] * len(self.pools)
        self.tally = DeviceTally([p.num_experts for p in self.pools])  # may be poisoned
        self._step_tally = None

    def output_unused(self) -> bool:
        """Whether the last layer may skip this multi-position call (unused_output.py): the
        engine says its output is dropped, and no request's trace records the model's routing
        (a bench's `trace` records what was routed, skipped calls not among them)."""
        if not self.unused_output.active or self.watch.observer is not None:
            return False
        self.unused_output.skipped += 1
        return True

    def on_device(self, layer: int) -> bool:
        """Whether this call of `layer` routes on the device: every expert of it is held, and no
        router trace or request recorder needs the choices on the host."""
        if not self.held[layer]:
            pool = self.pools[layer]
            if not pool.whole or self.spec.inflight(layer):
                return False
            pool.hold()  # device arrays in expert order: the router's indices are slots
            self.held[layer] = True
            log.debug("MoE layer %d holds every expert: routed on the device", layer)
        return self.device_routing and self.trace is None and self.watch.observer is None

    def route_on_device(self, layer: int, indices: mx.array) -> mx.array | None:
        """A held layer's call: its bookkeeping without the host. Returns an array the layer's
        output must depend on (the previous step's usage tally), or None."""
        self.tally.record(layer, indices)
        c = self.counters
        c.layer_calls += 1
        c.device_routed += 1
        dep, self._step_tally = self._step_tally, None
        return dep

    @contextmanager
    def prompt_end_step(self) -> Iterator[None]:
        """The engine's scope around a step that reads prompts' last tokens (mlx_compat.py, use
        11): what the last such step used and no pool holds yet is read ahead, layer by layer
        behind each other, and this step's choices are kept for the next (prompt_end.py)."""
        for layer in range(len(self.pools)):
            self.spec.complete(layer)  # what was read during the chunk: long landed, as a rule
            self._read_ahead(layer)
        with self.prompt_end.scope():
            yield

    def _read_ahead(self, layer: int) -> None:
        # Only reads that wait on the SSD are worth hiding: page-cache copies are quick, and a
        # copy beside the chunk takes a core from it (BENCHMARKS.md, agent turns, tenth session).
        if not self.bypass_page_cache:
            return
        experts = self.prompt_end.experts[layer]
        if experts is not None and not self.held[layer] and self.prompt_end.worthwhile:
            self.prompt_end.read(layer, self.spec.read_ahead(layer, experts, prompt_end=True))

    def fold_tally(self, evaluated: bool = False) -> None:
        """Held layers' hits into the host counters (no host sync: see DeviceTally.fold)."""
        _usage, hits = self.tally.fold(evaluated)
        for lc, h in zip(self.counters.layers, hits.tolist()):
            lc.device_hits = h

    def usage_counts(self) -> list[np.ndarray]:
        """Per layer and expert, the token rows routed to it (host- and device-routed calls).
        On the engine thread: it evaluates the held layers' pending tally."""
        device, _hits = self.tally.settle()
        for layer in range(len(self.usage)):
            self._fold_usage(layer)
        return [u + device[l, : u.shape[0]] for l, u in enumerate(self.usage)]

    def _read_back(self, layer: int, indices: mx.array, x: mx.array | None) -> float:
        """Evaluate the router's choices (the known cost centre, timed); returns when it ended."""
        c, fence, spec = self.counters, self.fence, self.spec
        tally, self._step_tally = self._step_tally, None
        predicted = spec.predict(layer, indices, x) if spec.enabled else None
        look = self.lookahead
        guess = look.predict(layer, indices, x) if look is not None else None
        t0 = time.perf_counter()
        # The one host sync of the layer also finishes every pending layer output (usually
        # ancestors of these indices anyway), so their slots are free to be overwritten after it.
        if predicted is None and tally is None and guess is None:  # the common call
            mx.eval(indices, *fence.outputs)
        else:
            extra = [a for a in (predicted, tally, guess) if a is not None]
            mx.eval(indices, *extra, *fence.outputs)
        fence.settled()
        on_sync = self.watch.on_sync
        if on_sync is not None:  # a device failure surfaces at this read-back
            on_sync(SyncPoint.ROUTER)
        c.host_syncs += 1
        t1 = time.perf_counter()
        c.router_sync_s += t1 - t0
        if tally is not None:
            self.fold_tally(evaluated=True)
        if spec.enabled:
            spec.predicted(layer, predicted)
        if look is not None:
            look.predicted(layer, guess)
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
        return self.loads.one_pass(layer, pool, ids, early, (graph, x, indices)), ids
