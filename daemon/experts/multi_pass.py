"""A streaming switch's calls that are not decode steps (streaming_switch.py): a prompt chunk's
sorted call on one pass, and a call whose distinct experts span several passes (a batch's union,
or a prompt chunk), each (token, expert) row computed once, in the pass that holds its expert,
the rows put back in order by a permutation. Each pass is shaped to take the gather kernel
mlx-lm's whole call takes on this backend (gather_kernel.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from moed.daemon.experts.gather_kernel import KernelMatch, PassShape

if TYPE_CHECKING:  # types only: streaming_switch.py builds a MultiPass
    from moed.daemon.experts.streaming_switch import LayerCache

# The switch's expert function: rows, slot ids, the sorted-rows flag, the pools.
ExpertFn = Callable[[mx.array, mx.array, bool, dict[str, mx.array]], mx.array]


class MultiPass:
    """One switch's non-decode calls, on its layer's passes (the switch keeps the decode path)."""

    def __init__(
        self,
        experts: ExpertFn,
        first_weight: str,
        layer: int,
        streamer: LayerCache,
        kernels: KernelMatch,
    ) -> None:
        self._experts = experts
        self._first_weight = first_weight  # the first projection's weight key in the pools
        self._layer = layer
        self._streamer = streamer
        self._kernels = kernels

    def _pool_experts(self, pools: dict[str, mx.array]) -> int:
        return int(pools[self._first_weight].shape[0])

    def _shaped(
        self, x: mx.array, idx: mx.array, shape: PassShape, pools: dict[str, mx.array]
    ) -> mx.array:
        """The expert function on `x`'s rows at `shape`: padded with copies of the last row
        (their outputs dropped), so that MLX picks mlx-lm's kernel for them."""
        own = x.shape[0]
        pad = shape.padding(own)
        if pad:
            x = mx.concatenate([x, mx.repeat(x[-1:], pad, axis=0)])
            idx = mx.concatenate([idx, mx.repeat(idx[-1:], pad, axis=0)])
        y = self._experts(x, idx, shape.sorted_rows, pools)
        return y[:own] if pad else y

    def sorted_one_pass(
        self, x: mx.array, idx: mx.array, needed: np.ndarray, experts: np.ndarray
    ) -> mx.array:
        """A prompt chunk whose experts fit the slots: mlx-lm's sorted gather over every row."""
        streamer, layer = self._streamer, self._layer
        table, pools = streamer.load(layer, experts)
        rows = idx.size
        shape = self._kernels.pass_shape(rows, True, rows, self._pool_experts(pools))
        y = self._shaped(x, mx.array(table)[idx], shape, pools)
        # Not evaluated here: the streamer fences it before any slot it reads is reused.
        streamer.defer(layer, y, table[needed].tolist())
        return y

    def rows_by_pass(
        self,
        x: mx.array,
        indices: mx.array,
        host: np.ndarray,
        passes: list[np.ndarray],
        do_sort: bool = False,
    ) -> mx.array:
        """Each pass computes only the (token, expert) rows of its own experts, so a call whose
        distinct experts span several passes costs one expert computation per row, not one per
        pass; the rows are put back in order by a permutation (no arithmetic), and each row is the
        same product as in one pass. A prompt chunk's rows (`do_sort`) go to each pass ordered by
        expert, as mlx-lm orders the whole chunk's for its sorted gather_qmm. A pass is shaped
        (padded, or its sort flag dropped) to take the kernel mlx-lm's call takes on this
        backend (gather_kernel.py)."""
        streamer, layer = self._streamer, self._layer
        flat = host.reshape(-1)
        rows = mx.broadcast_to(x, (*indices.shape, 1, x.shape[-1])).reshape(-1, 1, x.shape[-1])
        parts: list[mx.array] = []
        picked: list[np.ndarray] = []
        for done in streamer.load_passes(layer, passes):
            sel = np.flatnonzero(np.isin(flat, done.experts))
            if do_sort:
                sel = sel[np.argsort(flat[sel], kind="stable")]
            slots = done.table[flat[sel]]
            shape = self._kernels.pass_shape(
                flat.size, do_sort, sel.size, self._pool_experts(done.arrays)
            )
            y = self._shaped(rows[mx.array(sel)], mx.array(slots), shape, done.arrays)
            # Fenced before any slot it reads is reused; submitted now when the next pass's reads
            # land while it computes (pass_lane.py).
            streamer.submit_pass(layer, done, y, slots.tolist())
            parts.append(y)
            picked.append(sel)
        order = mx.array(np.argsort(np.concatenate(picked)))
        y = mx.concatenate(parts)[order]
        return y.reshape(*indices.shape, *y.shape[-2:])
