"""The prefix cache the engine asks when a request joins the batch and fills when a row's prompt
is read or its generation ends: a memory tier over an optional SSD tier."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from moed.daemon.engine.prefix_cache.entry import PrefixEntry
from moed.daemon.engine.prefix_cache.ladder import DecodeLadder
from moed.daemon.engine.prefix_cache.memory_tier import MemoryTier
from moed.daemon.engine.prefix_cache.scope import DEFAULT_SCOPE
from moed.daemon.model.layer_caches import LayerCache, own_arrays

if TYPE_CHECKING:  # the SSD tier is imported only where one is opened (setup.py)
    from moed.daemon.engine.prefix_cache.disk_tier import DiskTier
    from moed.daemon.engine.prefix_cache.disk_writer import Activity

log = logging.getLogger("moed.prefix_cache")


@dataclass(frozen=True)
class PrefixCacheConfig:
    memory_bytes: int  # the memory tier's budget; 0: no prefix cache at all
    disk_bytes: int  # the SSD tier's budget; 0: no SSD tier
    disk_dir: Path
    checkpoint_every: int  # tokens between recurrent-state checkpoints (hybrid models)
    max_checkpoints: int = 16  # per prompt: a long prompt spaces them wider
    # A checkpoint fewer tokens than this after where the row resumed is skipped: it would split a
    # chunk (under streaming one more read of every layer's experts) to save re-reading less than
    # a chunk, from the resume point, itself kept.
    min_split: int = 1
    # A row decoding alone keeps up to this many checkpoints behind its newest token (ladder.py),
    # in all at most a quarter of the memory tier.
    decode_checkpoints: int = 8

    @property
    def enabled(self) -> bool:
        return self.memory_bytes > 0


@dataclass(frozen=True)
class PrefixHit:
    length: int  # context tokens the caches hold
    caches: list[LayerCache]  # fresh per-layer caches for the row
    inherited: dict[
        int, list[LayerCache]
    ]  # checkpoints (position -> untrimmable states) the row's tokens share


@dataclass
class PrefixCounters:
    lookups: int = 0
    hits: int = 0
    tokens_reused: int = 0
    tokens_looked_up: int = 0
    stores: int = 0


class PrefixCache:
    """Owned by the engine thread (the SSD tier writes on a thread of its own)."""

    def __init__(
        self, cfg: PrefixCacheConfig, trimmable: tuple[bool, ...], disk: DiskTier | None = None
    ) -> None:
        self.cfg = cfg
        self.trimmable = trimmable
        self.memory = MemoryTier(cfg.memory_bytes, trimmable)
        self.disk = disk  # a DiskTier, or None
        self.counters = PrefixCounters()

    @property
    def hybrid(self) -> bool:
        return not all(self.trimmable)

    def lookup(self, context: list[int], scope: str = DEFAULT_SCOPE) -> PrefixHit | None:
        """The caches of `scope` (scope.py) that resume `context` furthest, leaving at least its
        last token to read (the step that reads it samples the first new token)."""
        self.counters.lookups += 1
        self.counters.tokens_looked_up += len(context)
        limit = len(context) - 1
        ctx = np.asarray(context, dtype=np.int32)
        entry, length = self.memory.best(ctx, limit, scope)
        if self.disk is not None:
            record, on_disk = self.disk.best(ctx, limit, scope)
            if record is not None and on_disk > length:
                loaded = self.disk.load(record)
                if loaded is not None:
                    self.memory.put(loaded)
                    entry, length = loaded, loaded.usable(on_disk, self.trimmable)
        if entry is None or length <= 0:
            return None
        self.memory.touch(entry)
        if self.disk is not None:
            self.disk.touch(entry.key)
        self.counters.hits += 1
        self.counters.tokens_reused += length
        return PrefixHit(
            length, entry.resume(length, self.trimmable), entry.checkpoints_upto(length)
        )

    def decode_ladder(self) -> DecodeLadder | None:
        """The checkpoints a hybrid model's row keeps while it decodes (None: none)."""
        if not self.hybrid or self.cfg.decode_checkpoints <= 0:
            return None
        return DecodeLadder(self.cfg.decode_checkpoints, self.cfg.memory_bytes // 4)

    def checkpoint_positions(self, start: int, context_len: int) -> tuple[int, ...]:
        """Where a hybrid model's row keeps recurrent state while its prompt is read: every
        `checkpoint_every` tokens (chunk boundaries), at most `max_checkpoints` of them."""
        if not self.hybrid:
            return ()
        end = context_len - 1  # the end of the prompt read: a message boundary
        every = max(self.cfg.checkpoint_every, -(-end // self.cfg.max_checkpoints))
        every = -(-every // self.cfg.checkpoint_every) * self.cfg.checkpoint_every
        first = start + max(1, self.cfg.min_split)
        return tuple(p for p in range(every, end, every) if p >= first)

    def store(
        self,
        tokens: list[int],
        layers: list[LayerCache],
        checkpoints: dict[int, list[LayerCache]],
        scope: str = DEFAULT_SCOPE,
    ) -> None:
        """Keep a row's caches (its `tokens`, with recurrent-state `checkpoints`) in `scope`."""
        if not tokens or not layers:
            return
        entry = PrefixEntry(
            np.asarray(tokens, dtype=np.int32),
            own_arrays(layers),
            {p: own_arrays(s) for p, s in checkpoints.items() if 0 < p < len(tokens)},
            scope=scope,
        )
        self.counters.stores += 1
        if self.memory.put(entry) and self.disk is not None:
            self.disk.write(entry)
        elif self.disk is not None and entry.nbytes <= self.disk.budget_bytes:
            self.disk.write(entry)  # too large for memory, not for the SSD

    def engine_is(self, activity: Activity) -> None:
        """What the engine does now: the SSD tier writes around prompts (disk_tier.py)."""
        if self.disk is not None:
            self.disk.engine_is(activity)

    def shed(self) -> int:
        """Empty the memory tier (the watchdog's first relief); the SSD tier stays."""
        released = self.memory.clear()
        if self.disk is not None:
            self.disk.write_now()
        if released:
            log.warning("prefix cache: memory tier emptied (%d bytes)", released)
        return released

    def clear(self) -> dict[str, Any]:
        memory = self.memory.clear()
        disk = self.disk.clear() if self.disk is not None else 0
        return {"memory_bytes": memory, "disk_bytes": disk}

    def entries(self) -> list[dict[str, Any]]:
        """Every entry of both tiers, most recently used first."""
        rows: dict[str, dict[str, Any]] = {}
        if self.disk is not None:
            for rec in self.disk.records():
                rows[rec.key] = {
                    "key": rec.key,
                    "scope": rec.scope,
                    "tokens": rec.length,
                    "checkpoints": len(rec.checkpoints),
                    "bytes": rec.nbytes,
                    "tiers": ["disk"],
                    "last_used": rec.last_used,
                }
        for e in self.memory.entries():
            row = rows.setdefault(
                e.key,
                {
                    "key": e.key,
                    "scope": e.scope,
                    "tokens": len(e.tokens),
                    "checkpoints": len(e.checkpoints),
                    "bytes": e.nbytes,
                    "tiers": [],
                    "last_used": e.last_used,
                },
            )
            row["tiers"].insert(0, "memory")
            row["last_used"] = max(row["last_used"], e.last_used)
        return sorted(rows.values(), key=lambda r: -r["last_used"])

    def snapshot(self) -> dict[str, Any]:
        c = self.counters
        snap = {
            "lookups": c.lookups,
            "hits": c.hits,
            "hit_rate": c.hits / c.lookups if c.lookups else None,
            "tokens_reused": c.tokens_reused,
            "tokens_looked_up": c.tokens_looked_up,
            "stores": c.stores,
            "memory_entries": len(self.memory),
            "memory_bytes": self.memory.bytes,
            "memory_budget_bytes": self.memory.budget_bytes,
            "memory_evictions": self.memory.evictions,
            "hybrid": self.hybrid,
        }
        if self.disk is not None:
            snap.update(self.disk.snapshot())
        return snap

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()
