"""One cached prefix: the tokens a row's caches hold, the caches, and recurrent-state checkpoints.

Attention layers can be cut back to any shorter prefix; the others cannot (model/layer_caches.py),
so an entry keeps their state at a few earlier positions too and a match resumes from the nearest
one.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from moed.daemon.model.layer_caches import LayerCache, cache_nbytes, resume_layers


def tokens_key(tokens: np.ndarray, scope: str = "") -> str:
    """A stable name for a token sequence of one scope (the SSD tier's file name)."""
    h = hashlib.sha256(f"{scope}\0".encode())
    h.update(np.ascontiguousarray(tokens, dtype="<i4").tobytes())
    return h.hexdigest()[:32]


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


def covers(
    new: np.ndarray,
    new_checkpoints: Iterable[int],
    old: np.ndarray,
    old_checkpoints: Iterable[int],
    trimmable: tuple[bool, ...],
) -> bool:
    """An entry of tokens `new` resumes everything one of tokens `old` can: its tokens extend
    old's, and (hybrid) it keeps state at every position old does."""
    if len(old) > len(new) or not np.array_equal(new[: len(old)], old):
        return False
    if all(trimmable):
        return True
    return {*old_checkpoints, len(old)} <= {*new_checkpoints, len(new)}


@dataclass
class PrefixEntry:
    tokens: np.ndarray  # int32: what `layers` hold, position 0 on
    layers: list[LayerCache]  # one single-row cache per layer, at len(tokens)
    # position -> the untrimmable layers' caches after that many tokens (in layer order)
    checkpoints: dict[int, list[LayerCache]] = field(default_factory=dict)
    last_used: float = field(default_factory=time.time)
    key: str = ""
    nbytes: int = 0
    scope: str = ""  # whose it is (scope.py): only requests of the same scope resume from it

    def __post_init__(self) -> None:
        self.key = self.key or tokens_key(self.tokens, self.scope)
        self.nbytes = cache_nbytes(self.layers) + sum(
            cache_nbytes(c) for c in self.checkpoints.values()
        )

    def usable(self, common: int, trimmable: tuple[bool, ...]) -> int:
        """The longest prefix of `common` matching tokens this entry can resume from."""
        return resumable(len(self.tokens), self.checkpoints, common, trimmable)

    def resume(self, length: int, trimmable: tuple[bool, ...]) -> list[LayerCache]:
        """Fresh per-layer caches holding the first `length` tokens (a `usable` length)."""
        whole = length == len(self.tokens)
        state = None if whole or all(trimmable) else self.checkpoints[length]
        return resume_layers(self.layers, length, trimmable, state)

    def checkpoints_upto(self, length: int) -> dict[int, list[LayerCache]]:
        """The checkpoints a row resumed at `length` inherits (its tokens agree up to there)."""
        return {p: s for p, s in self.checkpoints.items() if p <= length}

    def untrimmable_state(self, trimmable: tuple[bool, ...]) -> list[LayerCache]:
        return [c for c, cut in zip(self.layers, trimmable) if not cut]
