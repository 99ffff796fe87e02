"""Next-layer prefetch (`--prefetch-next`): while layer L computes, read the experts that layer
L+1's router picks for layer L's input. Exact either way (it only changes what is resident).

It pays only when its guesses are used and the reads it hides cost more than the router it runs
and the bandwidth it wastes, so it is a switch of the step tuner (tuning.py), kept on only while
it measurably saves time and enough of its guesses are used. Speculative reads queue behind demand
reads, and the ones a layer turns out not to need are cancelled before they start.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from moed.daemon.experts.cache import LayerPool
from moed.daemon.experts.counters import Counters
from moed.daemon.experts.landing import Staging
from moed.daemon.experts.prefetch import ReadBatch, ReadPool
from moed.daemon.experts.store import ExpertStore
from moed.daemon.experts.tuning import RecentShare, Switch

log = logging.getLogger(__name__)

MIN_ACCURACY = 0.3  # below this share of guesses used, speculation stays off
ACCURACY_STEPS = 64  # recent steps with speculation on that the accuracy covers


@dataclass
class Inflight:
    """One layer's speculative reads: per expert, its slot and its reads (one batch)."""

    slots: dict[int, int] = field(default_factory=dict)
    batches: dict[int, ReadBatch] = field(default_factory=dict)
    stagings: dict[int, Staging] = field(default_factory=dict)  # where each expert's reads land
    prompt_end: bool = False  # read ahead for a prompt's last token, not for the next layer


class SlotReads(Protocol):
    """What the speculator reads through (loads.py SlotLoads): the layers' pools, the read
    workers and the store, the counters, and slots claimed for its reads."""

    pools: list[LayerPool]
    reader: ReadPool
    store: ExpertStore
    counters: Counters

    def claim_slots(
        self, layer: int, experts: Iterable[int], keep: Sequence[int] = ()
    ) -> list[tuple[int, int]]: ...


class Speculator:
    """The speculative reads into a streamer's pools, through its loads (`SlotReads`)."""

    def __init__(self, reads: SlotReads, routers: list[nn.Module | None], enabled: bool):
        self.s = reads
        self.routers = routers  # per layer, the router the next-layer guess applies
        self.enabled = enabled
        self.switch = Switch("prefetch_next", active=enabled, allowed=self._accurate)
        self._predicted: tuple[int, np.ndarray] | None = None  # (layer, experts) to read next
        self._inflight: dict[int, Inflight] = {}
        self._recent = RecentShare(ACCURACY_STEPS)
        self._step_used = self._step_guessed = 0
        self._kept_stagings: dict[int, Staging] = {}

    @property
    def accuracy(self) -> float | None:
        """Share of the guesses that the next layer used, over recent steps with it on."""
        return self._recent.value

    def _accurate(self) -> bool:
        return (self.accuracy or 0.0) >= MIN_ACCURACY

    def end_step(self) -> None:
        self._recent.add(self._step_used, self._step_guessed)
        self._step_used = self._step_guessed = 0

    # -- prediction ------------------------------------------------------------------------

    def predict(self, layer: int, indices: mx.array, x: mx.array | None) -> mx.array | None:
        """Layer L+1's router applied to layer L's input (decode steps only: a few tokens)."""
        s, nxt = self.s, layer + 1
        if (
            not self.enabled
            or not self.switch.active
            or x is None
            or nxt >= len(s.pools)
            or (router := self.routers[nxt]) is None
        ):
            return None
        k = indices.shape[-1] if indices.ndim else 1
        if indices.size > 4 * k or s.pools[nxt].slots < 2 * k:
            return None  # prefill chunks route widely; tiny caches would only thrash
        out = router(x)
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
        self._step_guessed += len(self.read_ahead(layer, experts))

    def read_ahead(self, layer: int, experts: np.ndarray, prompt_end: bool = False) -> list[int]:
        """Queue speculative reads of those of `experts` that `layer`'s pool does not hold,
        unless reads are in flight for the layer already; returns the experts queued.
        `prompt_end`: a guess for a prompt's last token (prompt_end.py), counted apart from
        next-layer ones."""
        s = self.s
        pool = s.pools[layer]
        ids = [int(e) for e in experts]
        wanted = [e for e in ids if pool.slot_of[e] < 0]
        if not wanted or layer in self._inflight or len(ids) > pool.slots:
            return []
        # The guessed experts already held stay: the reads make room among the others.
        loads = s.claim_slots(layer, wanted, keep=[e for e in ids if pool.slot_of[e] >= 0])
        entry = Inflight(prompt_end=prompt_end)
        for e, slot in loads:  # a batch per expert: each can be cancelled on its own
            entry.slots[e] = slot
            entry.stagings[e] = staging = pool.stage([(e, slot)])
            entry.batches[e] = s.reader.submit(s.store.jobs_for(pool, staging), True)
        self._inflight[layer] = entry
        s.counters.prefetched += len(loads)
        if prompt_end:
            s.counters.prompt_end_reads += len(loads)
        return [e for e, _slot in loads]

    def inflight(self, layer: int) -> bool:
        """Speculative reads into `layer` are queued or running."""
        return layer in self._inflight

    def settle(
        self, layer: int, needed: set[int]
    ) -> tuple[set[int], list[ReadBatch], list[tuple[int, int]]]:
        """Before `layer` loads `needed`: speculative reads it needs move to the front of the
        queue; the others are cancelled (or waited for, when already running) and their experts
        given back. Returns (prefetched experts kept, their batches to wait for, their loads)."""
        entry = self._inflight.pop(layer, None)
        if entry is None:
            return set(), [], []
        s = self.s
        keep, batches, running, dropped = set(), [], [], []
        c = s.counters
        for e, batch in entry.batches.items():
            if e in needed:
                keep.add(e)
                batches.append(batch)
                continue
            if not s.reader.cancel(batch):
                running.append(batch)
            c.prefetch_cancelled_bytes += batch.cancelled_bytes
            dropped.append((e, entry.slots[e]))
        if batches:
            s.reader.promote(batches)
        if running:  # they write slots about to be given back: let them finish first
            try:
                c.prefetch_bytes += s.reader.wait(running).bytes_read  # read, and wasted
            except OSError:
                pass  # those experts are dropped anyway
        s.pools[layer].forget(dropped)
        s.counters.prefetch_dropped += len(dropped)
        if not entry.prompt_end:  # the next-layer switch's accuracy
            self._step_used += len(keep)
        self._kept_stagings = {e: entry.stagings[e] for e in keep}
        return keep, batches, [(e, entry.slots[e]) for e in keep]

    def stagings_of(self, loads: list[tuple[int, int]]) -> list[Staging]:
        """Where the kept speculative loads of the last `settle` land."""
        kept, self._kept_stagings = self._kept_stagings, {}
        return [kept[e] for e, _slot in loads if e in kept]

    def complete(self, layer: int) -> None:
        """Wait for `layer`'s speculative reads and land them all: its next call finds them
        resident, as plain hits (a failed read gives its slot back)."""
        entry = self._inflight.pop(layer, None)
        if entry is None:
            return
        s = self.s
        pool = s.pools[layer]
        try:
            res = s.reader.wait(list(entry.batches.values()))
        except OSError as exc:
            pool.forget(list(entry.slots.items()))
            log.warning("prefetch read failed: %s", exc)
            return
        for staging in entry.stagings.values():
            pool.land(staging)
        s.counters.prefetch_bytes += res.bytes_read

    def abandon(self) -> None:
        """A device failure: every speculative read is given up (the caller waits for the ones
        running: `ReadPool.quiesce`) and nothing predicted survives; the pools start over."""
        for entry in self._inflight.values():
            for batch in entry.batches.values():
                self.s.reader.cancel(batch)
        self._inflight.clear()
        self._predicted = None
        self._kept_stagings = {}

    def drain(self) -> None:
        """Land every layer's speculative reads (before a shed or a preload)."""
        for layer in list(self._inflight):
            self.complete(layer)

    def snapshot(self) -> dict[str, Any]:
        return {
            "prefetch_next_active": self.enabled and self.switch.active,
            "prefetch_accuracy": self.accuracy,
            "prefetch_net_ms_per_step": self.switch.net_ms,
            "prefetch_switches": self.switch.changes,
        }
