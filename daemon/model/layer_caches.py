"""mlx-lm's per-layer caches as the prefix cache handles them: which can be cut back to a shorter
prefix, evaluating a row's arrays into buffers of its own, and fresh caches resumed at a length.

Attention layers (mlx-lm's KVCache) can be cut back to any shorter prefix; other layers (the
linear-attention state of qwen3_next / qwen3_5_moe, rotating windows) cannot, so a resumed row
takes their state from a checkpoint kept at that length. One process's layers are handled here;
a pipeline's other ranks hold theirs behind a `RemoteLayers` handle that takes the same operations
as messages (distributed/cache_ops.py), and apply them here on their side.
"""

from __future__ import annotations

import copy
from typing import Any, Protocol, runtime_checkable

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache

# One layer's mlx-lm cache (KVCache, ArraysCache, RotatingKVCache, ...): mlx-lm duck-types them
# (state, nbytes, keys) and annotates none, so a precise type adds nothing.
LayerCache = Any


@runtime_checkable
class RemoteLayers(Protocol):
    """Layers another process holds for this row (a pipeline's followers), named by a handle."""

    def extract_state(self, idx: int) -> RemoteLayers:
        """Row `idx`'s state of the untrimmable layers (a checkpoint)."""
        ...

    def own(self) -> None:
        """Keep these layers in buffers of their own (the prefix cache holds them)."""
        ...

    def resume(self, length: int, state: RemoteLayers | None) -> RemoteLayers:
        """Fresh layers at `length` tokens: these cut back, the untrimmable ones from `state`."""
        ...


def trimmable_layers(layer_caches: list[LayerCache]) -> tuple[bool, ...]:
    """Which of a model's fresh layer caches can be cut back to a shorter prefix (by type: a fresh
    RotatingKVCache says it is trimmable until its window fills)."""
    return tuple(type(c) is KVCache for c in layer_caches)


def cache_nbytes(caches: list[LayerCache]) -> int:
    return sum(int(c.nbytes) for c in caches)


def extract_state(cache: LayerCache, idx: int) -> LayerCache:
    """Row `idx` of an untrimmable batch cache, for a checkpoint."""
    return cache.extract_state(idx) if isinstance(cache, RemoteLayers) else cache.extract(idx)


def lone_state(cache: LayerCache) -> LayerCache:
    """The state of a one-row batch's untrimmable cache, for a checkpoint: linear-attention
    state over the same arrays (a step replaces them, never writes into them), other caches
    sliced out (their arrays are written in place)."""
    if isinstance(cache, ArraysCache):
        return _copy_layer(cache)
    return extract_state(cache, 0)


def own_arrays(caches: list[LayerCache]) -> list[LayerCache]:
    """Evaluate the caches' arrays into buffers of their own: a row sliced out of a batch would
    otherwise keep the whole batch's buffer alive."""
    arrays = []
    for c in caches:
        if isinstance(c, RemoteLayers):
            c.own()
        else:
            arrays += _arrays(c)
    mx.eval(arrays)
    return caches


def resume_layers(
    layers: list[LayerCache],
    length: int,
    trimmable: tuple[bool, ...],
    state: list[LayerCache] | None,
) -> list[LayerCache]:
    """Fresh caches holding the first `length` tokens of `layers`: trimmable ones cut back, the
    others copied from `state` (the untrimmable layers' checkpoint at `length`, in layer order),
    or from `layers` themselves when `state` is None (they hold exactly `length` tokens)."""
    states = iter(state or ())
    out: list[LayerCache] = []
    for layer, cut in zip(layers, trimmable):
        if isinstance(layer, RemoteLayers):
            out.append(layer.resume(length, None if cut or state is None else next(states)))
        elif cut:
            kv = KVCache()
            kv.keys = layer.keys[..., :length, :]
            kv.values = layer.values[..., :length, :]
            kv.offset = length
            out.append(kv)
        else:
            out.append(_copy_layer(layer if state is None else next(states)))
    return out


def _arrays(cache: LayerCache) -> list[mx.array]:
    if isinstance(cache, KVCache):
        return [a for a in (cache.keys, cache.values) if a is not None]
    if isinstance(cache, ArraysCache):
        # mlx-lm infers ArraysCache.cache as list[None] from its __init__; it holds arrays.
        return [a for a in cache.cache if a is not None]  # type: ignore[misc]
    state = cache.state
    items = state if isinstance(state, (list, tuple)) else [state]
    return [a for a in items if isinstance(a, mx.array)]


def _copy_layer(cache: LayerCache) -> LayerCache:
    """A new cache object over the same (immutable) arrays: merging a row into a batch only reads
    it, and the copy keeps the entry's own object from being changed by anyone."""
    if isinstance(cache, ArraysCache):
        out = ArraysCache(len(cache.cache))
        out.cache = list(cache.cache)
        return out
    return copy.copy(cache)
