"""Idle-disk lookahead (`lookahead`): the experts layer L+1's router picks for layer L's input,
read while the disk would otherwise idle into a lane of host rows outside the pools, and copied
into the slots layer L+1's own admission gives them when its router does pick them.

Exact by construction: the pools admit and evict exactly as without it (a guess never takes a
slot, so a wrong one never evicts a needed expert), and a served expert's bytes are the ones its
demand read would have brought. Demand reads come first: lookahead jobs start only while no
demand job is queued or running (prefetch.py, `idle_only`), a few at once. A guess expires when
its layer's call starts: its reads still queued are cancelled, the finished ones are served or
dropped. Two lanes alternate by layer parity, so a layer's guesses never wait for the expired
ones of the layer before. Decode calls of one token only (top-k rows a lane: 2 x top-k experts
of host memory, outside the memory plan). A device failure's quiesced reads never count as
finished, so nothing they half wrote is served. Off by default: on a 2-core CPU it lost or
was a wash (BENCHMARKS.md, issue 36), as every engine that read ahead on predictions under a
saturated SSD measured.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np

from moed.daemon.experts.cache import LayerPool, PooledTensor
from moed.daemon.experts.landing import Staging
from moed.daemon.experts.prefetch import ReadBatch, ReadPool
from moed.daemon.experts.store import ExpertStore

log = logging.getLogger(__name__)


def next_layer_guess(router: Any, x: mx.array, k: int) -> mx.array:
    """The top-k experts of `router` (the next layer's) for `x` (this layer's input): the
    training-free next-layer gate. A router returns logits, or (indices, scores) (MoEGate)."""
    out = router(x)
    if isinstance(out, tuple):
        return mx.stop_gradient(out[0])
    return mx.argpartition(-out, kth=k - 1, axis=-1)[..., :k]


class Lane:
    """Host rows for one layer's guesses: row r holds one expert, its tensors back to back."""

    def __init__(self, rows: int, row_bytes: int):
        self.rows, self.row_bytes = rows, row_bytes
        self.view = memoryview(bytearray(rows * row_bytes))
        self.draining: list[ReadBatch] = []  # expired guesses' reads that may still run

    def row(self, row: int, tensors: Iterable[PooledTensor]) -> dict[str, memoryview]:
        """Row `row`'s bytes per tensor key, in `tensors`' order."""
        out, pos = {}, row * self.row_bytes
        for t in tensors:
            out[t.key] = self.view[pos : pos + t.slot_bytes]
            pos += t.slot_bytes
        return out


class _LaneTarget:
    """A layer's tensors read into lane rows (store.py ReadTarget): load (expert, row)."""

    def __init__(self, lane: Lane, tensors: list[PooledTensor]):
        self.lane, self.tensors = lane, tensors

    def destinations(self, staging: Staging, tensor: PooledTensor) -> list[memoryview]:
        return [self.lane.row(row, self.tensors)[tensor.key] for _e, row in staging.loads]


class _Subset:
    """Some loads of a pool's staging (store.py ReadTarget): the ones the lane did not serve."""

    def __init__(self, pool: LayerPool, staging: Staging, picked: list[int]):
        self.pool, self.staging, self.picked = pool, staging, picked
        self.tensors = pool.tensors

    def destinations(self, staging: Staging, tensor: PooledTensor) -> list[memoryview]:
        full = self.pool.destinations(self.staging, tensor)
        return [full[i] for i in self.picked]


@dataclass
class Guess:
    """One layer's prediction: every expert its router was guessed to pick, and the reads of the
    ones its pool did not hold (expert -> lane row, expert -> its batch)."""

    layer: int
    predicted: frozenset[int]
    rows: dict[int, int] = field(default_factory=dict)
    batches: dict[int, ReadBatch] = field(default_factory=dict)


@dataclass
class LookaheadCounters:
    guessed: int = 0  # experts read into a lane
    served: int = 0  # of those, copied into a slot the layer's admission gave them
    served_bytes: int = 0
    expired: int = 0  # queued or unfinished when their layer started: cancelled or dropped
    wasted: int = 0  # read in full, not picked by the layer
    wait_s: float = 0.0  # the engine thread waiting for a lane's expired reads
    # per layer: [predicted experts the layer's call picked, experts it picked]
    recall: list[list[int]] = field(default_factory=list)


class Lookahead:
    def __init__(
        self, pools: Sequence[LayerPool], reader: ReadPool, store: ExpertStore, routers: list[Any]
    ):
        self.pools, self.reader, self.store, self.routers = pools, reader, store, routers
        self.lanes: list[Lane] = []  # two, made with the first guess (its top-k sets the rows)
        self._guesses: dict[int, Guess] = {}
        self._pending: tuple[int, list[int]] | None = None  # (layer, experts) not issued yet
        self.counters = LookaheadCounters(recall=[[0, 0] for _ in pools])

    # -- the read-back (host_route.py) -----------------------------------------------------

    def predict(self, layer: int, indices: mx.array, x: mx.array | None) -> mx.array | None:
        """The next layer's guess for a one-token call, evaluated with the read-back."""
        nxt = layer + 1
        k = indices.shape[-1] if indices.ndim else 1
        if x is None or nxt >= len(self.pools) or indices.size > k:
            return None
        router = self.routers[nxt]
        return None if router is None else next_layer_guess(router, x, k)

    def predicted(self, layer: int, guess: mx.array | None) -> None:
        """After `layer`'s read-back: every other layer's guess expires (a call that took no
        lookahead hook left its own), and the guess for the next layer waits for `issue`."""
        for other in [g for g in self._guesses if g != layer]:
            self._expire(self._guesses.pop(other), set())
        self._pending = None
        if guess is not None:
            self._pending = (layer + 1, [int(e) for e in np.array(guess).ravel()])

    # -- a layer's admission (host_route.py, loads.py) -------------------------------------

    def serve(
        self, layer: int, pool: LayerPool, staging: Staging, needed: Iterable[int]
    ) -> ReadBatch | None:
        """The demand reads of `staging` (its loads admitted as without lookahead): the loads
        whose guessed reads finished are copied from the lane, the others read (a batch, or None
        where the lane served every one). Then the next layer's guess is issued."""
        guess = self._guesses.pop(layer, None)
        wanted = set(needed)
        served: list[int] = []
        if guess is not None:
            finished = self.reader.finished
            served = [
                i
                for i, (e, _slot) in enumerate(staging.loads)
                if (b := guess.batches.get(e)) is not None and finished(b)
            ]
        batch = None
        if len(served) < len(staging.loads):
            done = set(served)
            rest = [i for i in range(len(staging.loads)) if i not in done]
            target = _Subset(pool, staging, rest) if served else pool
            sub = Staging([staging.loads[i] for i in rest]) if served else staging
            batch = self.reader.submit(self.store.jobs_for(target, sub))
        if guess is not None:
            self._copy(guess, pool, staging, served)
            self._expire(guess, wanted, {staging.loads[i][0] for i in served})
        self._issue(layer + 1)
        return batch

    def issue(self, layer: int, needed: Iterable[int]) -> None:
        """A call of `layer` that reads nothing: its guess expires, the next layer's is issued."""
        guess = self._guesses.pop(layer, None)
        if guess is not None:
            self._expire(guess, set(needed))
        self._issue(layer + 1)

    def _copy(self, guess: Guess, pool: LayerPool, staging: Staging, served: list[int]) -> None:
        lane = self.lanes[guess.layer % 2]
        rows = [lane.row(guess.rows[staging.loads[i][0]], pool.tensors) for i in served]
        for t in pool.tensors:
            dests = pool.destinations(staging, t)
            for i, row in zip(served, rows):
                dests[i][:] = row[t.key]
        c = self.counters
        c.served += len(served)
        c.served_bytes += len(served) * pool.expert_bytes

    def _expire(self, guess: Guess, needed: set[int], served: Iterable[int] = ()) -> None:
        """`guess`'s layer started: count what it found, cancel its queued reads; the running
        ones are waited for before its lane is written again."""
        c = self.counters
        if needed:
            rec = c.recall[guess.layer]
            rec[0] += len(guess.predicted & needed)
            rec[1] += len(needed)
        done = set(served)
        lane = self.lanes[guess.layer % 2]
        for e, batch in guess.batches.items():
            if e in done:
                continue
            if self.reader.finished(batch):
                c.wasted += e not in needed
                continue
            c.expired += 1
            if not self.reader.cancel(batch):
                lane.draining.append(batch)

    def _issue(self, layer: int) -> None:
        """Queue the idle-only reads of the pending guess for `layer` into its lane."""
        pending, self._pending = self._pending, None
        if pending is None or pending[0] != layer:
            return
        experts = pending[1]
        pool = self.pools[layer]
        if not self.lanes:
            rows = len(experts)
            row_bytes = max(p.expert_bytes for p in self.pools)
            self.lanes = [Lane(rows, row_bytes), Lane(rows, row_bytes)]
        lane = self.lanes[layer % 2]
        if lane.draining:  # expired reads into these rows: long finished, as a rule
            t0 = time.perf_counter()
            try:
                self.reader.wait(lane.draining)
            except OSError:
                pass  # those rows are written again below anyway
            lane.draining = []
            self.counters.wait_s += time.perf_counter() - t0
        guess = Guess(layer, frozenset(experts))
        slot_of = pool.slot_list
        missing = sorted({e for e in experts if slot_of[e] < 0})[: lane.rows]
        target = _LaneTarget(lane, pool.tensors)
        for row, e in enumerate(missing):  # a batch per expert: each is served on its own
            guess.rows[e] = row
            jobs = self.store.jobs_for(target, Staging([(e, row)]))
            guess.batches[e] = self.reader.submit(jobs, idle_only=True)
        self.counters.guessed += len(missing)
        self._guesses[layer] = guess

    def snapshot(self) -> dict[str, Any]:
        c = self.counters
        return {
            "lookahead_guessed": c.guessed,
            "lookahead_served": c.served,
            "lookahead_served_bytes": c.served_bytes,
            "lookahead_expired": c.expired,
            "lookahead_wasted": c.wasted,
            "lookahead_wait_s": c.wait_s,
            "lookahead_recall": [list(r) for r in c.recall],
        }
