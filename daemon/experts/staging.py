"""The STAGED landing's host rows: a small ring of them per pool, allocated once.

Each pool tensor gets one `(rows, ...)` MLX array made from host data (managed memory on CUDA),
advised to stay in host memory and mapped for the GPU (cuda_memory.py), so a read lands in it at
memory speed and the pool's scatter reads it over the bus; no copy into a fresh array per burst.

A row is in one of three states: FREE, READING (a staging's reads land in it) and LANDED (its
staging's scatter is queued, lazily). A LANDED row may only be written again once that scatter ran:
like the streamer's lazy fence, the ring evaluates the pool's arrays (which include every scatter
queued so far) only when it needs a LANDED row back, and then every LANDED row is FREE. In decode
the layer's output, evaluated at the next router read-back, has run the scatter long before the
layer's next burst, so that evaluation finds nothing left to do.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping

import mlx.core as mx
import numpy as np

from moed.daemon.experts.cuda_memory import advise_host
from moed.daemon.experts.landing import Staging

FREE, READING, LANDED = 0, 1, 2
DEFAULT_ROWS = 8  # a decode burst's misses of one layer (a few, up to top-k); more spill


class StagingRing:
    def __init__(self, rows: int, row_shapes: Mapping[str, tuple[tuple[int, ...], type, mx.Dtype]]):
        """`row_shapes`: per tensor key, (shape of one row, numpy dtype to allocate, MLX dtype)."""
        self.rows = rows
        self.arrays: dict[str, mx.array] = {}
        for key, (shape, np_dtype, mx_dtype) in row_shapes.items():
            arr = mx.array(np.zeros((rows, *shape), dtype=np_dtype))
            self.arrays[key] = arr.view(mx_dtype) if arr.dtype != mx_dtype else arr
        mx.eval(*self.arrays.values())
        self.advised = [advise_host(a) for a in self.arrays.values()].count(True)
        # Byte views the read workers write through; row i of `key` is rows_bytes[key] * i onwards.
        self.views: dict[str, memoryview] = {
            # mx.array exports the buffer protocol; its stubs declare no __buffer__.
            k: memoryview(a).cast("B")  # type: ignore[arg-type]
            for k, a in self.arrays.items()
        }
        self.row_bytes = {k: a.nbytes // rows for k, a in self.arrays.items()}
        self.state = [FREE] * rows
        self._reading: dict[int, Staging] = {}  # first row -> the staging reading into it
        self._next = 0  # next-fit: rows freed longest ago are reused first
        self.settles = 0  # evaluations to get LANDED rows back (counted, like fences)

    def take(self, staging: Staging, pool_arrays: Iterable[mx.array]) -> bool:
        """Give `staging` contiguous rows (staging.first); False when the ring cannot hold it (the
        caller stages it elsewhere). `pool_arrays`: what to evaluate to free LANDED rows."""
        n = len(staging.loads)
        if not 0 < n <= self.rows:
            return False
        first = self._find(n)
        if first is None and LANDED in self.state:
            self.settle(pool_arrays)
            first = self._find(n)
        if first is None:
            return False
        self.state[first : first + n] = [READING] * n
        self._reading[first] = staging
        staging.first = first
        self._next = (first + n) % self.rows
        return True

    def _find(self, n: int) -> int | None:
        """The first run of n FREE rows from `_next` on (runs do not wrap past the end)."""
        state = self.state
        for start in itertools.chain(range(self._next, self.rows - n + 1), range(self._next)):
            if start + n <= self.rows and all(s == FREE for s in state[start : start + n]):
                return start
        return None

    def view(self, key: str, row: int) -> memoryview:
        n = self.row_bytes[key]
        return self.views[key][row * n : (row + 1) * n]

    def rows_of(self, key: str, staging: Staging) -> mx.array:
        """The staging's rows of one tensor (a slice: no copy), for the pool's scatter."""
        return self.arrays[key][staging.first : staging.first + len(staging.loads)]

    def landed(self, staging: Staging) -> None:
        """The staging's scatter is queued: its rows wait for it to run."""
        self._reading.pop(staging.first, None)
        n = len(staging.loads)
        self.state[staging.first : staging.first + n] = [LANDED] * n

    def abandon(self, loads: Iterable[tuple[int, int]]) -> None:
        """Loads given up after their reads ended (a failed read, a dropped speculative one): the
        rows of a staging all of whose loads are among them are FREE again (nothing reads them)."""
        gone = set(loads)
        for first, staging in list(self._reading.items()):
            if gone.issuperset(staging.loads):
                del self._reading[first]
                self.state[first : first + len(staging.loads)] = [FREE] * len(staging.loads)

    def settle(self, pool_arrays: Iterable[mx.array]) -> None:
        """Run every queued scatter (the pool's current arrays hold them all): LANDED -> FREE."""
        if LANDED not in self.state:
            return
        mx.eval(*pool_arrays)
        self.settles += 1
        self.state = [FREE if s == LANDED else s for s in self.state]
