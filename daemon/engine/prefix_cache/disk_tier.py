"""The SSD tier: prefix entries as safetensors files (mlx-lm's save_prompt_cache) in one folder,
bounded in bytes, least recently used out first, written on a thread of its own and atomically
(a temporary file renamed into place), each stamped with a fingerprint of the model's files,
moed's version and the cache layout. It survives idle unloads, restarts and crashes.

The writer stays out of time to first token. The engine tells the tier what it is doing
(`Activity`): while a row reads its prompt, queued entries wait (at most HOLD_MAX_S each, and
never while HOLD_QUEUE of them wait: a server always reading some prompt still writes them);
while rows only decode, they are written at once; on an idle engine, once it has been idle for
QUIET_S (an agent's next turn often follows its answer at once, and a write started then shares
the prefill's cores and GIL). An entry queued behind one that it covers (a row's whole generation
after its prompt) replaces it, so a short turn is written once. Measured on a 2-core machine, a
prefix-hit turn's first token came 14 ms later (of 100) while its prompt's entry was written
beside it.

Like every side file it is advisory: a corrupt, truncated or foreign entry is skipped with a
warning, a full disk or a read-only folder is a warning, and the request is served either way.
"""

from __future__ import annotations

import base64
import enum
import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from moed.daemon.engine.prefix_cache.entry import PrefixEntry, common_prefix, covers, resumable
from moed.daemon.model.cache_file import (
    FORMAT,
    SUFFIX,
    entry_files,
    read_caches,
    read_metadata,
    write_caches,
)
from moed.daemon.model.cache_file import unlink as _unlink
from moed.daemon.model.layer_caches import RemoteLayers

log = logging.getLogger("moed.prefix_cache")

WRITE_QUEUE = 8  # entries waiting for the writer; more are dropped (the cache is advisory)
HOLD_MAX_S = 10.0  # a busy engine delays an entry's write at most this long (a crash loses less)
HOLD_QUEUE = WRITE_QUEUE // 2  # this many waiting are written anyway: a busy server drops none
QUIET_S = 0.2  # an idle engine's writes wait this long: a client's next turn may come at once


class Activity(enum.Enum):
    """What the engine is doing, as the SSD writer needs to know it."""

    PROMPT = "prompt"  # a row is reading its prompt: writes wait
    DECODE = "decode"  # rows only decode: writes go out now
    IDLE = "idle"  # no rows: writes go out once it has been idle for QUIET_S


class RemoteParts(Protocol):
    """The layers of each entry that other processes hold (a pipeline's followers, behind the
    last element of every layer list): they keep files of their own, in step with this tier."""

    def persist(self, entry: PrefixEntry) -> None:
        """Write their part of `entry` (called once this tier has written its own; from its
        writer thread)."""
        ...

    def forget(self, key: str) -> None:
        """Remove their part of the entry `key` (this tier will not hold it)."""
        ...

    def clear(self) -> None: ...

    def load(self, key: str, positions: tuple[int, ...]) -> tuple[Any, list[Any]] | None:
        """Their part of `key`: the layers' element and one per checkpoint (none when their
        layers can all be cut back); None when any of them could not read it."""
        ...


@dataclass
class DiskRecord:
    key: str
    path: Path
    tokens: np.ndarray
    checkpoints: tuple[int, ...]
    nbytes: int
    last_used: float

    @property
    def length(self) -> int:
        return len(self.tokens)


class DiskTier:
    def __init__(
        self,
        directory: Path,
        budget_bytes: int,
        fingerprint: str,
        trimmable: tuple[bool, ...],
        remote: RemoteParts | None = None,
    ) -> None:
        self.dir = Path(directory)
        self.budget_bytes = budget_bytes
        self.fingerprint = fingerprint
        self.trimmable = trimmable
        # Under a pipeline each layer list ends with the followers' element: this tier writes
        # this process's layers, `remote` has the followers keep theirs.
        self.remote = remote
        self._local = len(trimmable) - (1 if remote is not None else 0)
        self._lock = threading.Lock()  # the records, shared with the writer thread
        self._records: dict[str, DiskRecord] = {}
        self._foreign: dict[Path, tuple[int, float]] = {}  # other models' entries: size, mtime
        self._warned: set[str] = set()
        self.loads = self.writes = self.evictions = self.skipped = self.write_errors = 0
        self.on_written: Callable[[], None] = lambda: (
            None
        )  # the owner republishes its counters (writer thread)
        self._scan()
        # The writer's queue: (entry, when queued), and what the engine is doing since when.
        self._wake = threading.Condition()
        self._pending: deque[tuple[PrefixEntry, float]] = deque()
        self._activity, self._idle_since = Activity.IDLE, time.monotonic()
        self._closing = False
        self._cleared = self._writing_epoch = 0  # clears: a write begun before one is dropped
        self._flushing = 0  # callers of flush(): the queue is written whatever the hold
        self._urgent = 0  # memory is short: this many of the first queued go out now
        self._unfinished = 0  # queued or being written
        self._writer = threading.Thread(
            target=self._write_loop, name="moed-prefix-ssd", daemon=True
        )
        self._writer.start()

    # ---- the index ----------------------------------------------------------------------------
    def _scan(self) -> None:
        try:
            paths = entry_files(self.dir)
        except OSError as exc:
            self._warn("dir", f"prefix cache: cannot use {self.dir} ({exc}); no SSD tier")
            return
        foreign = 0
        for path in paths:
            try:
                meta, st = read_metadata(path), path.stat()
                if meta.get("format") != FORMAT or meta.get("fingerprint") != self.fingerprint:
                    self._foreign[path] = (st.st_size, st.st_mtime)
                    foreign += 1
                    continue
                self._records[path.stem] = self._record(path, meta, st.st_size, st.st_mtime)
            except (OSError, ValueError, KeyError) as exc:
                self.skipped += 1
                log.warning("prefix cache: skipping corrupt entry %s (%s)", path.name, exc)
                _unlink(path)
        if foreign:
            self.skipped += foreign
            log.warning(
                "prefix cache: %d entries in %s are of another model, moed version or cache "
                "layout; skipped (they leave as the least recently used)",
                foreign,
                self.dir,
            )

    @staticmethod
    def _record(path: Path, meta: dict[str, Any], size: int, mtime: float) -> DiskRecord:
        tokens = np.frombuffer(base64.b64decode(meta["tokens"]), dtype="<i4").astype(np.int32)
        checkpoints = tuple(int(p) for p in json.loads(meta["checkpoints"]))
        return DiskRecord(path.stem, path, tokens, checkpoints, size, mtime)

    def records(self) -> list[DiskRecord]:
        with self._lock:
            return list(self._records.values())

    def best(self, context: np.ndarray, limit: int) -> tuple[DiskRecord | None, int]:
        found, length = None, 0
        for rec in self.records():
            common = min(common_prefix(rec.tokens, context), limit)
            usable = resumable(rec.length, rec.checkpoints, common, self.trimmable)
            if usable > length:
                found, length = rec, usable
        return found, length

    def touch(self, key: str) -> None:
        with self._lock:
            rec = self._records.get(key)
            if rec is None:
                return
            rec.last_used = time.time()
        try:
            os.utime(rec.path)  # the LRU order survives a restart
        except OSError:
            pass

    # ---- reading ------------------------------------------------------------------------------
    def load(self, rec: DiskRecord) -> PrefixEntry | None:
        """The entry of `rec`, or None (with a warning, the file removed) when it cannot be read."""
        try:
            caches, _ = read_caches(rec.path, self.fingerprint)
            local = self.trimmable[: self._local]
            layers, rest = caches[: self._local], caches[self._local :]
            width = sum(not t for t in local)
            if len(layers) != self._local or len(rest) != width * len(rec.checkpoints):
                raise ValueError("its layers do not match the model's")
            checkpoints = {
                p: rest[i * width : (i + 1) * width] for i, p in enumerate(rec.checkpoints)
            }
        except Exception as exc:  # corrupt, truncated, foreign: never a failed request
            log.warning("prefix cache: skipping unreadable entry %s (%s)", rec.path.name, exc)
            self.skipped += 1
            self._forget(rec.key, unlink=True)
            return None
        if self.remote is not None:
            parts = self.remote.load(rec.key, rec.checkpoints)
            if parts is None:
                log.warning("prefix cache: another rank could not read its part of %s", rec.key)
                self.skipped += 1
                self._forget(rec.key, unlink=True)
                return None
            theirs, states = parts
            layers = [*layers, theirs]
            if states:  # the followers keep recurrent state: each checkpoint's list ends with it
                checkpoints = {p: [*checkpoints[p], s] for p, s in zip(rec.checkpoints, states)}
        entry = PrefixEntry(rec.tokens.copy(), layers, checkpoints, key=rec.key)
        self.loads += 1
        return entry

    # ---- writing ------------------------------------------------------------------------------
    def write(self, entry: PrefixEntry) -> None:
        """Queue `entry` for the writer (its arrays are evaluated: the writer only reads them)."""
        if entry.nbytes > self.budget_bytes:
            return
        with self._wake:
            if self._closing:
                return
            kept: list[tuple[PrefixEntry, float]] = []
            since = time.monotonic()
            for e, t in self._pending:  # the ones `entry` covers leave: it is written instead
                if covers(entry.tokens, entry.checkpoints, e.tokens, e.checkpoints, self.trimmable):
                    since = min(since, t)  # their queue time: a crash loses no more than before
                    self._unfinished -= 1
                else:
                    kept.append((e, t))
            if len(kept) >= WRITE_QUEUE:
                log.debug("prefix cache: SSD writer busy; entry %s not written", entry.key)
            else:
                kept.append((entry, since))
                self._unfinished += 1
            self._pending = deque(kept)
            self._wake.notify_all()

    def engine_is(self, activity: Activity) -> None:
        """The engine's word on what it does now (it calls this whenever that may change)."""
        with self._wake:
            if activity is not self._activity:
                if activity is Activity.IDLE:
                    self._idle_since = time.monotonic()
                self._activity = activity
                self._wake.notify_all()

    def write_now(self) -> None:
        """Memory is short (the watchdog's shed): the queued entries hold arrays the memory tier
        let go, so they are written at once, whatever the engine does, and released."""
        with self._wake:
            self._urgent = len(self._pending)
            self._wake.notify_all()

    def _wait_s(self, since: float, now: float) -> float:
        """How long the first queued entry (queued at `since`) still waits; <= 0: write it."""
        if self._closing or self._flushing or self._urgent or len(self._pending) >= HOLD_QUEUE:
            return 0.0
        if self._activity is Activity.DECODE:
            return 0.0
        held = since + HOLD_MAX_S - now
        if self._activity is Activity.PROMPT:
            return held
        return min(held, max(self._idle_since, since) + QUIET_S - now)

    def _next_entry(self) -> PrefixEntry | None:
        """The next entry to write once the engine allows it; None when closing with none left."""
        with self._wake:
            while True:
                if self._pending:
                    wait = self._wait_s(self._pending[0][1], time.monotonic())
                    if wait <= 0:
                        self._writing_epoch = self._cleared
                        self._urgent = max(0, self._urgent - 1)
                        return self._pending.popleft()[0]
                    self._wake.wait(wait)
                elif self._closing:
                    return None
                else:
                    self._wake.wait()

    def _write_loop(self) -> None:
        while (entry := self._next_entry()) is not None:
            try:
                self._write(entry)
                self.on_written()
            except Exception:  # a bug here must not kill the writer silently
                log.exception("prefix cache: SSD write failed")
            finally:
                # Not held while the next one is awaited: its arrays (a pipeline's twin lists
                # in the other ranks too) go with the memory tier's copy.
                entry = None
                with self._wake:
                    self._unfinished -= 1
                    self._wake.notify_all()

    def _write(self, entry: PrefixEntry) -> None:
        final = self.dir / (entry.key + SUFFIX)
        positions = sorted(entry.checkpoints)
        # This process's layers only: the followers' element (a pipeline's) writes its own.
        caches = list(entry.layers[: self._local]) + [
            c for p in positions for c in entry.checkpoints[p] if not isinstance(c, RemoteLayers)
        ]
        meta = {
            "tokens": base64.b64encode(np.asarray(entry.tokens, dtype="<i4").tobytes()).decode(),
            "checkpoints": json.dumps(positions),
        }
        try:
            size = write_caches(final, caches, self.fingerprint, meta)
        except (OSError, RuntimeError, ValueError) as exc:  # full disk, read-only folder, ...
            self.write_errors += 1
            self._warn(
                "write:" + type(exc).__name__,
                f"prefix cache: cannot write to {self.dir} ({exc}); requests are served, "
                "this entry stays in memory only",
            )
            return
        self.writes += 1
        rec = DiskRecord(entry.key, final, entry.tokens, tuple(positions), size, time.time())
        with self._lock:
            if self._writing_epoch != self._cleared:  # a clear came while it was written
                _unlink(final)  # (the followers' part went with the clear)
                return
            self._records[entry.key] = rec
            superseded = [r for r in self._records.values() if self._covers(rec, r)]
        if self.remote is not None:
            # The followers write their part now too, when this tier's hold let it go (not
            # beside a prefill), and only parts of entries this tier holds.
            self.remote.persist(entry)
        for old in superseded:
            self._forget(old.key, unlink=True)
        self._enforce_budget()

    def _covers(self, new: DiskRecord, old: DiskRecord) -> bool:
        return old.key != new.key and covers(
            new.tokens, new.checkpoints, old.tokens, old.checkpoints, self.trimmable
        )

    def _enforce_budget(self) -> None:
        with self._lock:
            files: list[tuple[float, int, Path, str | None]] = [
                (r.last_used, r.nbytes, r.path, r.key) for r in self._records.values()
            ]
            files += [(m, s, p, None) for p, (s, m) in self._foreign.items()]
        total = sum(f[1] for f in files)
        for _, size, path, key in sorted(files, key=lambda f: f[0]):
            if total <= self.budget_bytes:
                break
            if key is not None:
                self._forget(key, unlink=True)
            else:
                _unlink(path)
                with self._lock:
                    self._foreign.pop(path, None)
            total -= size
            self.evictions += 1

    def _forget(self, key: str, unlink: bool) -> None:
        with self._lock:
            rec = self._records.pop(key, None)
        if rec is not None and unlink:
            _unlink(rec.path)
            if self.remote is not None:
                self.remote.forget(key)

    def _warn(self, kind: str, message: str) -> None:
        if kind not in self._warned:  # one warning per kind of failure, not one per request
            self._warned.add(kind)
            log.warning("%s", message)

    # ---- the rest -----------------------------------------------------------------------------
    def clear(self) -> int:
        """Remove every entry, the ones still queued for the writer included."""
        with self._wake:
            self._unfinished -= len(self._pending)
            self._pending.clear()
            self._urgent = 0
            self._wake.notify_all()
        with self._lock:
            self._cleared += 1
            paths = [(r.path, r.nbytes) for r in self._records.values()]
            paths += [(p, s) for p, (s, _) in self._foreign.items()]
            self._records.clear()
            self._foreign.clear()
        for path, _ in paths:
            _unlink(path)
        if self.remote is not None:
            self.remote.clear()
        return sum(s for _, s in paths)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            ours = sum(r.nbytes for r in self._records.values())
            foreign = sum(s for s, _ in self._foreign.values())
            entries = len(self._records)
        return {
            "disk_dir": str(self.dir),
            "disk_entries": entries,
            "disk_bytes": ours + foreign,
            "disk_budget_bytes": self.budget_bytes,
            "disk_evictions": self.evictions,
            "disk_loads": self.loads,
            "disk_writes": self.writes,
            "disk_write_errors": self.write_errors,
            "disk_skipped": self.skipped,
        }

    def flush(self, timeout: float = 30.0) -> None:
        """Wait until every queued entry is written (tests, and a clean shutdown); a hold does
        not delay them."""
        deadline = time.monotonic() + timeout
        with self._wake:
            self._flushing += 1
            self._wake.notify_all()
            while self._unfinished and (left := deadline - time.monotonic()) > 0:
                self._wake.wait(left)
            self._flushing -= 1

    def close(self) -> None:
        with self._wake:
            self._closing = True  # the queued entries are written first, whatever the hold
            self._wake.notify_all()
        self._writer.join(timeout=60)


def clear_folder(directory: Path) -> int:
    """Remove every entry file of a folder (no tier open on it); returns the bytes removed."""
    removed = 0
    try:
        paths = list(Path(directory).rglob("*" + SUFFIX))  # a pipeline's ranks: a folder each
    except OSError:
        return 0
    for path in paths:
        try:
            size = path.stat().st_size
            path.unlink()
            removed += size
        except OSError:
            pass
    return removed
