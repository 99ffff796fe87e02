"""A per-layer hook for prompt chunks: each decoder layer of a chunk is evaluated as it is built
and reported, so progress is seen inside a forward pass that takes minutes.

The hook changes no weight and no module path: each layer's class becomes a subclass whose
`__call__` calls the original, then (for a prompt chunk only) evaluates its output and calls
`on_layer`. Evaluating a layer's output early computes the same values with the same kernels
(mlx-lm's forward is not compiled); a decode step (one position per row) is left as it was, one
graph, with no extra host sync.

The last layer's output is never forced: a prompt chunk keeps only the caches (mlx-lm evaluates
their state, not the logits), and the last layer's cache needs its key/value projections alone,
so forcing its output would compute its attention over the whole context and its experts for
nothing (a quarter of the demo model's chunk). Whoever wants that output evaluates it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx

from moed.daemon.model.mlx_compat import recast

_HOOKED = "_moed_layer_hook"  # marks a hooked subclass: hooking twice wraps once


def watch_layers(model: Any, on_layer: Callable[[], None]) -> int:
    """Hook every decoder layer of an mlx-lm model (its `layers`); returns how many."""
    layers = list(getattr(model, "layers", None) or [])
    hooked: dict[tuple[type, bool], type] = {}
    for i, layer in enumerate(layers):
        base = type(layer)
        if getattr(base, _HOOKED, False):
            base = base.__mro__[1]
        last = i == len(layers) - 1
        sub = hooked.get((base, last))
        if sub is None:
            sub = hooked[base, last] = _hooked_class(base, on_layer, force=not last)
        recast(layer, sub)
    return len(layers)


def _hooked_class(base: type, on_layer: Callable[[], None], force: bool) -> type:
    # A decoder layer's call: its hidden states in, mlx-lm's own arguments passed through.
    def __call__(self: object, x: mx.array, *args: Any, **kwargs: Any) -> Any:
        out = base.__call__(self, x, *args, **kwargs)
        # (batch, positions, hidden): more than one position is a prompt chunk.
        if getattr(x, "ndim", 0) >= 3 and x.shape[-2] > 1:
            if force:
                mx.eval(out)
            on_layer()
        return out

    return type(base.__name__, (base,), {"__call__": __call__, _HOOKED: True})
