"""Layers whose every expert is held route on the device: no read-back, no fence.

A layer is held once its pool has a slot for each of its experts and all of them are loaded
(a full budget once warm). Nothing in it can miss and no slot of it is ever overwritten (a shed
re-allocates the arrays), so it needs neither the router's choices on the host nor the lazy fence.
Its pool is copied by the device into expert order when it becomes held (cache.py `hold`), so the
router's indices address the slots directly and the call is mlx-lm's own SwitchGLU call on the
pool, sort rule and all.

What the host still wants from such a layer (per-expert usage for the profile, hits per layer for
`moe stats`) is tallied on the device every few steps and read back only where the engine has
synchronized anyway (`DeviceTally.fold`), so `moe stats` shows those hits up to two tallies late.
"""

from __future__ import annotations

from collections import deque

import mlx.core as mx
import numpy as np


class DeviceTally:
    """Usage counts of held layers, accumulated on the device: one update every few steps for
    all of them, chained into a step's graph, folded into host counters when already evaluated."""

    EVERY = 16  # steps per update: its few kernels cost ~7% of a 2.5 ms token if run every step

    def __init__(self, num_experts: list[int]):
        self.width = max(num_experts) if num_experts else 0
        self.layers = len(num_experts)
        self._calls: list[tuple[int, mx.array]] = []  # (layer, indices) since the last update
        self._steps = 0
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

    def step(self) -> mx.array | None:
        """A new forward step: every `EVERY` steps the calls since the last tally become one
        device update. Returns the array the caller must make its graph depend on (so it is
        computed with the step, never alone), or None."""
        self._steps += 1
        return self.flush() if self._steps % self.EVERY == 0 else None

    def flush(self) -> mx.array | None:
        """The recorded calls as one device update (a few kernels for many steps' calls)."""
        if not self._calls:
            return None
        calls, self._calls = self._calls, []
        w = self.width
        flat = mx.concatenate(
            [idx.reshape(-1).astype(mx.int32) + i * w for i, (_l, idx) in enumerate(calls)]
        )
        per_call = mx.zeros(len(calls) * w, dtype=mx.int32).at[flat].add(1).reshape(-1, w)
        layer_of = mx.array([layer for layer, _idx in calls], dtype=mx.int32)
        usage = mx.zeros((self.layers, w), dtype=mx.int32).at[layer_of].add(per_call)
        distinct = (per_call > 0).sum(axis=1).astype(mx.int32)  # a call's hits: its experts
        hits = mx.zeros(self.layers, dtype=mx.int32).at[layer_of].add(distinct)
        if self._total is not None:
            usage, hits = self._total[0] + usage, self._total[1] + hits
        self._total = (usage, hits)
        self._unread.append(self._total)
        return usage

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
