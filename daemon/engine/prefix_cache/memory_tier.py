"""The memory tier: prefix entries under a byte budget, least recently used out first."""

from __future__ import annotations

import time
from collections import OrderedDict

import numpy as np

from moed.daemon.engine.prefix_cache.entry import PrefixEntry, common_prefix


class MemoryTier:
    def __init__(self, budget_bytes: int, trimmable: tuple[bool, ...]) -> None:
        self.budget_bytes = budget_bytes
        self.trimmable = trimmable
        self._entries: OrderedDict[str, PrefixEntry] = OrderedDict()  # oldest use first
        self.bytes = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def entries(self) -> list[PrefixEntry]:
        # One C-level copy (atomic under the GIL): the SSD writer's thread lists them too.
        return list(self._entries.values())

    def best(self, context: np.ndarray, limit: int, scope: str) -> tuple[PrefixEntry | None, int]:
        """The entry of `scope` that resumes `context` furthest (at most `limit` tokens) and that
        length."""
        found, length = None, 0
        for entry in self._entries.values():
            if entry.scope != scope:
                continue
            usable = entry.usable(min(common_prefix(entry.tokens, context), limit), self.trimmable)
            if usable > length:
                found, length = entry, usable
        return found, length

    def touch(self, entry: PrefixEntry) -> None:
        entry.last_used = time.time()
        if entry.key in self._entries:
            self._entries.move_to_end(entry.key)

    def put(self, entry: PrefixEntry) -> bool:
        """Keep `entry` (False when it alone exceeds the budget). Entries of its scope it extends
        are merged into it: their tokens are its prefix, so their checkpoints are still its own."""
        if entry.nbytes > self.budget_bytes:
            return False
        for old in list(self._entries.values()):
            if old.scope != entry.scope:
                continue
            n = len(old.tokens)
            if n <= len(entry.tokens) and common_prefix(old.tokens, entry.tokens) == n:
                self._drop(old.key)
                if n < len(entry.tokens) and not all(self.trimmable):
                    merged = {n: old.untrimmable_state(self.trimmable), **old.checkpoints}
                    for pos, state in merged.items():
                        if pos not in entry.checkpoints and 0 < pos < len(entry.tokens):
                            entry.checkpoints[pos] = state
                    entry.__post_init__()  # its size grew
        self._drop(entry.key)
        self._entries[entry.key] = entry
        self.bytes += entry.nbytes
        while self.bytes > self.budget_bytes and self._entries:
            oldest = next(iter(self._entries))
            self._drop(oldest)
            self.evictions += 1
        return entry.key in self._entries

    def _drop(self, key: str) -> None:
        old = self._entries.pop(key, None)
        if old is not None:
            self.bytes -= old.nbytes

    def clear(self) -> int:
        """Empty the tier; returns the bytes released."""
        released = self.bytes
        self._entries.clear()
        self.bytes = 0
        return released
