"""Layers whose every expert is held route on the device: no read-back, no fence.

A layer is held once its pool has a slot for each of its experts and all of them are loaded
(a full budget once warm). Nothing in it can miss and no slot of it is ever overwritten (a shed
re-allocates the arrays), so it needs neither the router's choices on the host nor the lazy fence.
Its pool is put in expert order when it becomes held, so the router's indices address the slots
directly and the call is mlx-lm's own SwitchGLU call on the pool, sort rule and all.

What the host still wants from such a layer (per-expert usage for the profile, hits per layer for
`moe stats`) is tallied on the device once per step and read back only where the engine has
synchronized anyway (`DeviceTally.fold`).
"""

from __future__ import annotations

from collections import deque

import mlx.core as mx
import numpy as np


class DeviceTally:
    """Usage counts of held layers, accumulated on the device: one scatter per step for all of
    them, chained into the next step's graph, folded into host counters when already evaluated."""

    def __init__(self, num_experts: list[int]):
        self.width = max(num_experts) if num_experts else 0
        self.layers = len(num_experts)
        self._calls: list[tuple[int, mx.array]] = []  # (layer, indices) of the step being built
        self._total: tuple[mx.array, mx.array] | None = None  # cumulative (usage, hits), newest
        # Cumulative tallies not read yet, oldest first: the newest may still be computing, the
        # one before it belongs to a step the engine has already read a token of.
        self._unread: deque[tuple[mx.array, mx.array]] = deque(maxlen=2)
        self._read = (
            np.zeros((self.layers, self.width), np.int64),
            np.zeros(self.layers, np.int64),
        )

    def record(self, layer: int, indices: mx.array) -> None:
        self._calls.append((layer, indices))

    def flush(self) -> mx.array | None:
        """At a new step: the previous step's calls as one device update. Returns the array the
        caller must make its graph depend on (so it is computed with the step, never alone)."""
        if not self._calls:
            return None
        flat = mx.concatenate(
            [idx.reshape(-1).astype(mx.int32) + layer * self.width for layer, idx in self._calls]
        )
        self._calls = []
        counts = mx.zeros(self.layers * self.width, dtype=mx.int32).at[flat].add(1)
        counts = counts.reshape(self.layers, self.width)
        hits = (counts > 0).sum(axis=1).astype(mx.int32)  # distinct experts per layer call
        if self._total is not None:
            counts, hits = self._total[0] + counts, self._total[1] + hits
        self._total = (counts, hits)
        self._unread.append(self._total)
        return counts

    def fold(self, evaluated: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """The cumulative (usage per layer and expert, hits per layer) as host arrays. Reads the
        newest tally only when `evaluated` (the caller just synchronized), else the one before,
        which is complete once the engine has a later token: never a host sync of its own."""
        if self._unread and (evaluated or len(self._unread) == 2):
            usage, hits = self._unread[-1] if evaluated else self._unread.popleft()
            self._read = (np.array(usage, dtype=np.int64), np.array(hits, dtype=np.int64))
            if evaluated:
                self._unread.clear()
        return self._read

    def settle(self) -> tuple[np.ndarray, np.ndarray]:
        """Everything tallied so far (evaluates: for saving the profile or an idle engine)."""
        self.flush()
        if self._total is not None:
            mx.eval(*self._total)
        return self.fold(evaluated=True)
