"""One cached prefix: the tokens a row's caches hold, the caches, and recurrent-state checkpoints.

Attention layers (mlx-lm's KVCache) can be cut back to any shorter prefix; other layers (the
linear-attention state of qwen3_next / qwen3_5_moe, rotating windows) cannot, so an entry keeps
their state at a few earlier positions too and a match resumes from the nearest one.
"""

from __future__ import annotations

import copy
import hashlib
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import ArraysCache, KVCache

# One layer's mlx-lm cache (KVCache, ArraysCache, RotatingKVCache, ...): mlx-lm duck-types them
# (state, nbytes, keys) and annotates none, so a precise type adds nothing.
LayerCache = Any


def trimmable_layers(layer_caches: list[LayerCache]) -> tuple[bool, ...]:
    """Which of a model's fresh layer caches can be cut back to a shorter prefix (by type: a fresh
    RotatingKVCache says it is trimmable until its window fills)."""
    return tuple(type(c) is KVCache for c in layer_caches)


def tokens_key(tokens: np.ndarray) -> str:
    """A stable name for a token sequence (the SSD tier's file name)."""
    return hashlib.sha256(np.ascontiguousarray(tokens, dtype="<i4").tobytes()).hexdigest()[:32]


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


def resumable(
    length: int, checkpoints: Iterable[int], common: int, trimmable: tuple[bool, ...]
) -> int:
    """How many of `common` matching tokens an entry of `length` tokens with recurrent-state
    `checkpoints` (positions) can resume from: all of them when every layer can be cut back,
    else the nearest checkpoint at or before them."""
    if common >= length:
        return length
    if all(trimmable):
        return common
    return max((p for p in checkpoints if p <= common), default=0)


def cache_nbytes(caches: list[LayerCache]) -> int:
    return sum(int(c.nbytes) for c in caches)


def own_arrays(caches: list[LayerCache]) -> list[LayerCache]:
    """Evaluate the caches' arrays into buffers of their own: a row sliced out of a batch would
    otherwise keep the whole batch's buffer alive."""
    arrays = [a for c in caches for a in _arrays(c)]
    mx.eval(arrays)
    return caches


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


@dataclass
class PrefixEntry:
    tokens: np.ndarray  # int32: what `layers` hold, position 0 on
    layers: list[LayerCache]  # one single-row cache per layer, at len(tokens)
    # position -> the untrimmable layers' caches after that many tokens (in layer order)
    checkpoints: dict[int, list[LayerCache]] = field(default_factory=dict)
    last_used: float = field(default_factory=time.time)
    key: str = ""
    nbytes: int = 0

    def __post_init__(self) -> None:
        self.key = self.key or tokens_key(self.tokens)
        self.nbytes = cache_nbytes(self.layers) + sum(
            cache_nbytes(c) for c in self.checkpoints.values()
        )

    def usable(self, common: int, trimmable: tuple[bool, ...]) -> int:
        """The longest prefix of `common` matching tokens this entry can resume from."""
        return resumable(len(self.tokens), self.checkpoints, common, trimmable)

    def resume(self, length: int, trimmable: tuple[bool, ...]) -> list[LayerCache]:
        """Fresh per-layer caches holding the first `length` tokens (a `usable` length)."""
        whole = length == len(self.tokens)
        states = iter(() if whole or all(trimmable) else self.checkpoints[length])
        out = []
        for layer, cut in zip(self.layers, trimmable):
            if cut:
                kv = KVCache()
                kv.keys = layer.keys[..., :length, :]
                kv.values = layer.values[..., :length, :]
                kv.offset = length
                out.append(kv)
            else:
                out.append(_copy_layer(layer if whole else next(states)))
        return out

    def checkpoints_upto(self, length: int) -> dict[int, list[LayerCache]]:
        """The checkpoints a row resumed at `length` inherits (its tokens agree up to there)."""
        return {p: s for p, s in self.checkpoints.items() if p <= length}

    def untrimmable_state(self, trimmable: tuple[bool, ...]) -> list[LayerCache]:
        return [c for c, cut in zip(self.layers, trimmable) if not cut]
