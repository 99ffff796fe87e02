"""The prefix feed: what the engine hands the prefix cache, and when.

Which rows' caches are kept (a row that ended by itself or was cancelled; never one of a failed
batch or a recovery), when they are stored (once the row's first token is out: a store evaluates
copies of the caches, milliseconds that must not stand between a prompt's end and its first
token), and the SSD tier's write gate (what the engine is doing: on a few cores a write beside a
prefill delays its first token, prefix_cache/disk_tier.py). The engine core holds one for its
life; the cache inside opens with each load and closes with each unload.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any, Protocol

from moed.daemon.config import ServeConfig
from moed.daemon.engine.batch import SavedRow
from moed.daemon.engine.prefix_cache.cache import PrefixCache, PrefixHit
from moed.daemon.engine.prefix_cache.disk_tier import clear_folder
from moed.daemon.engine.prefix_cache.disk_writer import Activity
from moed.daemon.engine.prefix_cache.setup import open_prefix_cache, prefix_cache_config
from moed.daemon.engine.status import EngineStatus
from moed.daemon.model.loader import LoadedModel

log = logging.getLogger("moed.engine")


class RowProgress(Protocol):
    """What the feed reads of a running row: whether its first token is out."""

    @property
    def first_token_at(self) -> float | None: ...


class PrefixFeed:
    """Keeps, stores and gates the prefix cache's writes; publishes its state to the status."""

    def __init__(self, serve: ServeConfig, status: EngineStatus, cleared: Callable[[], None]):
        self.serve = serve
        self.status = status
        self.cleared = cleared  # after the tiers were emptied (the pipeline's ranks follow)
        self.cache: PrefixCache | None = None  # while a model is loaded and the cache is on
        self._unsaved: list[SavedRow] = []  # kept rows waiting for their first token

    def open(self, loaded: LoadedModel, model_path: Path) -> None:
        """The cache of a model just loaded (kept across a reload that failed half-way)."""
        if self.cache is None:
            try:
                self.cache = open_prefix_cache(self.serve, loaded, model_path)
            except Exception:  # advisory: the daemon serves without it
                log.exception("the prefix cache could not start; serving without it")
            if self.cache is not None and self.cache.disk is not None:
                # Counters read from the writer thread: plain values the engine only replaces.
                self.cache.disk.on_written = self.publish
        self.publish()

    def close(self) -> None:
        if self.cache is not None:
            self.cache.close()  # the SSD tier's pending writes land first
            self.cache = None
            self.publish()

    def lookup(self, context: list[int], scope: str) -> tuple[PrefixHit | None, tuple[int, ...]]:
        """The hit in `scope` for a joining row and where to checkpoint it (advisory: a failure
        here is a warning and a full prompt read)."""
        if self.cache is None:
            return None, ()
        try:
            hit = self.cache.lookup(context, scope)
            start = hit.length if hit is not None else 0
            return hit, self.cache.checkpoint_positions(start, len(context))
        except Exception:
            log.exception("prefix cache lookup failed; reading the whole prompt")
            return None, ()

    def keep(self, row: SavedRow | None) -> None:
        """A row's caches to store once its first token is out (nothing while the cache is off)."""
        if self.cache is not None and row is not None:
            self._unsaved.append(row)

    def store_due(self, running: Mapping[int, RowProgress]) -> None:
        """Store the kept rows whose first token went out (or whose row ended: not in `running`),
        in the order they were kept: a row's longer entry, kept at its end, merges the shorter."""
        if not self._unsaved or self.cache is None:
            return
        waiting = []
        for row in self._unsaved:
            gen = running.get(row.uid)
            if gen is not None and gen.first_token_at is None:
                waiting.append(row)
                continue
            try:
                self.cache.store(row.tokens, row.layers, row.checkpoints, row.scope)
            except Exception:
                log.exception("prefix cache store failed")
        stored = len(waiting) < len(self._unsaved)
        self._unsaved = waiting
        if stored:  # every step asks while a row waits for its first token: publish only news
            self.publish()

    def drop_unsaved(self) -> None:
        """Forget the kept rows: caches of a batch whose state is unknown (a failed step)."""
        self._unsaved.clear()

    def gate(self, running: Collection[RowProgress]) -> None:
        """Tell the SSD tier what the engine does: a row reading its prompt holds its writes."""
        if self.cache is None:
            return
        if any(gen.first_token_at is None for gen in running):
            self.cache.engine_is(Activity.PROMPT)
        else:
            self.cache.engine_is(Activity.DECODE if running else Activity.IDLE)

    def shed(self) -> int:
        """Release the memory tier (memory pressure); the bytes given back."""
        self._unsaved.clear()
        if self.cache is None:
            return 0
        released = self.cache.shed()
        self.publish()
        return released

    def clear(self) -> dict[str, Any]:
        """Empty both tiers; with no cache open, the SSD tier's folder all the same."""
        self._unsaved.clear()
        if self.cache is not None:
            released = self.cache.clear()
            self.cleared()
        else:
            released = {"disk_bytes": clear_folder(prefix_cache_config(self.serve, None).disk_dir)}
        self.publish()
        return released

    def publish(self) -> None:
        cache = self.cache
        self.status.update(
            prefix_cache=cache.snapshot() if cache is not None else None,
            prefix_entries=cache.entries() if cache is not None else None,
        )
