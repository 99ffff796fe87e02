"""Next-layer prefetch (`--prefetch-next`): while layer L computes, read the experts that layer
L+1's router picks for layer L's input. Exact either way (it only changes what is resident).

It pays only when its guesses are used and the reads it hides cost more than the router it runs
and the bandwidth it wastes, so a governor measures that on the running workload: it alternates
probe windows with speculation on and off, keeps the faster setting for a while, then probes
again. Speculative reads queue behind demand reads, and the ones a layer turns out not to need
are cancelled before they start.
"""

from __future__ import annotations

import logging
import statistics
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

log = logging.getLogger(__name__)

WINDOW = 16  # decode steps per probe window
HOLD = 8  # windows to keep the chosen setting before probing again
MIN_ACCURACY = 0.3  # below this share of guesses used, speculation stays off


@dataclass
class Inflight:
    """One layer's speculative reads: per expert, its slot and its read jobs."""

    slots: dict[int, int] = field(default_factory=dict)
    futures: dict[int, list[Future]] = field(default_factory=dict)
    nbytes: dict[int, list[int]] = field(default_factory=dict)  # per job, as `futures`


class PrefetchGovernor:
    """Decides per decode step whether speculation runs, from measured step times."""

    def __init__(self):
        self.active = True
        self._phase: list[bool] = [True, False]  # probe: one window on, one window off
        self._hold = 0
        self._times: dict[bool, list[float]] = {True: [], False: []}
        self._window: list[float] = []
        self._used = self._guessed = 0
        self.accuracy: float | None = None  # share of guesses used, last window with it on
        self.net_ms: float | None = None  # step time saved by speculation (off minus on)
        self.switches = 0

    def on_step(self, step_s: float, used: int, guessed: int) -> None:
        """One decode step finished in `step_s`; speculation guessed `guessed` experts and
        `used` of them were needed."""
        self._window.append(step_s)
        self._used += used
        self._guessed += guessed
        if len(self._window) < WINDOW:
            return
        median = statistics.median(self._window)
        self._window = []
        if self.active and self._guessed:
            self.accuracy = self._used / self._guessed
        self._used = self._guessed = 0
        if self._hold > 0:
            self._hold -= 1
            if self._hold == 0:
                self._phase = [True, False]
                self._set(True)
            return
        self._times[self.active] = [median]
        self._phase.pop(0)
        if self._phase:
            self._set(self._phase[0])
            return
        on, off = self._times[True][0], self._times[False][0]
        self.net_ms = 1e3 * (off - on)
        accurate = self.accuracy is not None and self.accuracy >= MIN_ACCURACY
        self._set(accurate and on < off)
        self._hold = HOLD
        log.debug(
            "prefetch-next %s: accuracy %s, net %.2f ms per step",
            "on" if self.active else "off",
            self.accuracy,
            self.net_ms,
        )

    def _set(self, active: bool) -> None:
        if active != self.active:
            self.switches += 1
        self.active = active


class Speculator:
    """The speculative reads of an ExpertStreamer (pools, store, reader and counters are its)."""

    def __init__(self, streamer, enabled: bool):
        self.s = streamer
        self.enabled = enabled
        self.governor = PrefetchGovernor() if enabled else None
        self._predicted: tuple[int, np.ndarray] | None = None  # (layer, experts) to read next
        self._inflight: dict[int, Inflight] = {}
        self._step_t0: float | None = None
        self._step_used = self._step_guessed = 0

    # -- the step clock (layer 0's router read-back) ----------------------------------------

    def begin_step(self, decode: bool) -> None:
        now = time.perf_counter()
        gov = self.governor
        if gov is not None and self._step_t0 is not None and decode:
            gov.on_step(now - self._step_t0, self._step_used, self._step_guessed)
        self._step_t0 = now if decode else None
        self._step_used = self._step_guessed = 0

    # -- prediction ------------------------------------------------------------------------

    def predict(self, layer: int, indices: mx.array, x: mx.array | None) -> mx.array | None:
        """Layer L+1's router applied to layer L's input (decode steps only: a few tokens)."""
        s, nxt = self.s, layer + 1
        if (
            not self.enabled
            or not self.governor.active
            or x is None
            or nxt >= len(s.pools)
            or s.routers[nxt] is None
        ):
            return None
        k = indices.shape[-1] if indices.ndim else 1
        if indices.size > 4 * k or s.pools[nxt].slots < 2 * k:
            return None  # prefill chunks route widely; tiny caches would only thrash
        out = s.routers[nxt](x)
        if isinstance(out, tuple):  # MoEGate returns (indices, scores)
            return mx.stop_gradient(out[0])
        return mx.argpartition(-out, kth=k - 1, axis=-1)[..., :k]

    def predicted(self, layer: int, predicted: mx.array | None) -> None:
        """Called after the read-back evaluated the prediction."""
        self._predicted = (
            (layer + 1, np.unique(np.array(predicted))) if predicted is not None else None
        )

    # -- reads -----------------------------------------------------------------------------

    def issue(self, layer: int) -> None:
        """Queue the reads predicted for `layer` (behind every demand read)."""
        if self._predicted is None or self._predicted[0] != layer:
            return
        experts, self._predicted = self._predicted[1], None
        s = self.s
        pool = s.pools[layer]
        wanted = [int(e) for e in experts if pool.slot_of[e] < 0]
        if not wanted or layer in self._inflight:
            return
        _hits, loads = s._admit(pool, wanted)
        s._fence(layer, loads)
        entry = Inflight()
        for e, slot in loads:
            jobs = s.store.jobs_for(pool, [(e, slot)])
            entry.slots[e] = slot
            entry.futures[e] = s.reader.submit(jobs, speculative=True)
            entry.nbytes[e] = [j.nbytes for j in jobs]
        self._inflight[layer] = entry
        s.counters.prefetched += len(loads)
        self._step_guessed += len(loads)

    def settle(self, layer: int, needed: set[int]) -> tuple[set[int], list[Future], list]:
        """Before `layer` loads `needed`: speculative reads it needs move to the front of the
        queue; the others are cancelled (or waited for, when already running) and their experts
        given back. Returns (prefetched experts kept, their futures to wait for, their loads)."""
        entry = self._inflight.pop(layer, None)
        if entry is None:
            return set(), [], []
        s = self.s
        keep, futures, running, dropped = set(), [], [], []
        c = s.counters
        for e, futs in entry.futures.items():
            if e in needed:
                keep.add(e)
                futures += futs
                continue
            s.reader.cancel(futs)
            for f, n in zip(futs, entry.nbytes[e]):
                if f.cancelled():
                    c.prefetch_cancelled_bytes += n
                else:
                    running.append(f)
            dropped.append((e, entry.slots[e]))
        if futures:
            s.reader.promote(futures)
        if running:  # they write slots about to be given back: let them finish first
            try:
                c.prefetch_bytes += s.reader.wait(running).bytes_read  # read, and wasted
            except OSError:
                pass  # those experts are dropped anyway
        s.pools[layer].forget(dropped)
        s.counters.prefetch_dropped += len(dropped)
        self._step_used += len(keep)
        return keep, futures, [(e, entry.slots[e]) for e in keep]

    def drain(self) -> None:
        """Settle every layer's speculative reads (before a shed or a preload)."""
        for layer in list(self._inflight):
            _keep, futures, loads = self.settle(layer, set(self._inflight[layer].slots))
            try:
                res = self.s.reader.wait(futures)
            except OSError as exc:
                self.s.pools[layer].forget(loads)
                log.warning("prefetch read failed: %s", exc)
                continue
            self.s.counters.prefetch_bytes += res.bytes_read

    def snapshot(self) -> dict:
        gov = self.governor
        return {
            "prefetch_next_active": bool(gov and gov.active),
            "prefetch_accuracy": None if gov is None else gov.accuracy,
            "prefetch_net_ms_per_step": None if gov is None else gov.net_ms,
            "prefetch_switches": 0 if gov is None else gov.switches,
        }
