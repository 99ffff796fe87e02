"""The SSD tier: prefix entries as safetensors files (model/cache_file.py) in one private folder,
bounded in bytes, least recently used out first, written on a thread of its own
(disk_writer.py: out of time to first token) and atomically, each stamped with a fingerprint of
the model's files, moed's version and the cache layout, and bound by a digest to its name, its
token ids, checkpoints and scope. It survives idle unloads, restarts and crashes.

Like every side file it is advisory and trusts nothing it finds: a file that is not a regular file
of this user's, a header that does not add up, a digest or name that disagrees with the contents
is skipped, counted by reason (`disk_rejected`) and, when it is a file of ours, removed; another
model's entries are kept until they are the least recently used. A full disk or a read-only folder
is a warning. The request is served either way, and never from an entry it cannot trust.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import re
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from moed.daemon.engine.prefix_cache.disk_writer import Activity, WriteQueue
from moed.daemon.engine.prefix_cache.entry import (
    PrefixEntry,
    common_prefix,
    covers,
    resumable,
    tokens_key,
)
from moed.daemon.model.cache_file import (
    SUFFIX,
    check_stamp,
    entry_files,
    read_caches,
    read_metadata,
    write_caches,
)
from moed.daemon.model.cache_file import unlink as _unlink
from moed.daemon.model.cache_folder import MODELS_FOLDER
from moed.daemon.model.entry_file import EntryProblem, EntryRejected
from moed.daemon.model.layer_caches import RemoteLayers

log = logging.getLogger("moed.prefix_cache")

__all__ = ["Activity", "DiskRecord", "DiskTier", "RemoteParts", "clear_folder"]

# Problems of a file of ours that can never be used: it is removed. Others (not a regular
# file, another user's, an I/O error) are left where they are, skipped at every start.
_REMOVED = frozenset({EntryProblem.MALFORMED, EntryProblem.MISMATCH, EntryProblem.TOO_LARGE})
_SCOPE = re.compile(r"(?:[0-9a-f]{32})?")


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
    scope: str = ""

    @property
    def length(self) -> int:
        return len(self.tokens)


def record_of(path: Path, meta: dict[str, str], size: int, mtime: float) -> DiskRecord:
    """The index row of an entry's metadata; EntryRejected unless its token ids, checkpoints and
    scope are well formed and name the file (a flipped bit in its ids is caught here)."""
    try:
        raw = base64.b64decode(meta["tokens"], validate=True)
        checkpoints = json.loads(meta["checkpoints"])
        scope = meta["scope"]
    except (KeyError, ValueError, RecursionError):
        raise EntryRejected(EntryProblem.MALFORMED, "its token ids are malformed") from None
    n = len(raw) // 4
    if not raw or len(raw) % 4 or not _SCOPE.fullmatch(scope):
        raise EntryRejected(EntryProblem.MALFORMED, "its token ids or scope are malformed")
    if not isinstance(checkpoints, list) or not all(
        type(p) is int and 0 < p < n for p in checkpoints
    ):
        raise EntryRejected(EntryProblem.MALFORMED, "its checkpoints are malformed")
    tokens = np.frombuffer(raw, dtype="<i4").astype(np.int32)
    if tokens_key(tokens, scope) != path.stem:
        raise EntryRejected(EntryProblem.MISMATCH, "its token ids do not match its name")
    return DiskRecord(path.stem, path, tokens, tuple(checkpoints), size, mtime, scope)


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
        self.rejected: Counter[EntryProblem] = Counter()  # entries skipped, by why
        self.on_written: Callable[[], None] = lambda: (
            None
        )  # the owner republishes its counters (writer thread)
        self.usable = self._scan()
        self._queue = WriteQueue(self._write_and_publish, trimmable)

    # ---- the index ----------------------------------------------------------------------------
    def _scan(self) -> bool:
        try:
            paths = entry_files(self.dir)
        except OSError as exc:  # cannot be made or read, or others can write it
            self._warn("dir", f"prefix cache: cannot use {self.dir} ({exc}); no SSD tier")
            return False
        skipped: dict[EntryProblem, list[str]] = {}
        for path in paths:
            try:
                meta, size, mtime = read_metadata(path, self.budget_bytes)
                try:
                    check_stamp(meta, self.fingerprint, path)
                except EntryRejected as exc:
                    if exc.problem is not EntryProblem.FOREIGN:
                        raise
                    self._foreign[path] = (size, mtime)  # it leaves as the least recently used
                    self.skipped += 1
                    skipped.setdefault(EntryProblem.FOREIGN, []).append(path.name)
                    continue
                self._records[path.stem] = record_of(path, meta, size, mtime)
            except EntryRejected as exc:
                self._reject(path, exc)
                skipped.setdefault(exc.problem, []).append(f"{path.name}: {exc.why}")
        for problem, names in skipped.items():
            self._report_scan(problem, names)
        return True

    def _report_scan(self, problem: EntryProblem, names: list[str]) -> None:
        """One warning per kind of problem a start found, naming a few of the files."""
        if problem is EntryProblem.FOREIGN:
            log.warning(
                "prefix cache: %d entries in %s are of another model, moed version or file "
                "format; skipped (they leave as the least recently used)",
                len(names),
                self.dir,
            )
            return
        shown = "; ".join(ascii(n) for n in names[:3]) + ("; ..." if len(names) > 3 else "")
        log.warning(
            "prefix cache: skipped %d entries in %s (%s): %s",
            len(names),
            self.dir,
            problem.value,
            shown,
        )

    def _reject(self, path: Path, exc: EntryRejected) -> None:
        self.skipped += 1
        self.rejected[exc.problem] += 1
        if exc.problem in _REMOVED:
            _unlink(path)

    def records(self) -> list[DiskRecord]:
        with self._lock:
            return list(self._records.values())

    def best(self, context: np.ndarray, limit: int, scope: str) -> tuple[DiskRecord | None, int]:
        found, length = None, 0
        for rec in self.records():
            if rec.scope != scope:
                continue
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
            os.utime(rec.path, follow_symlinks=False)  # the LRU order survives a restart
        except (OSError, NotImplementedError):
            pass

    # ---- reading ------------------------------------------------------------------------------
    def load(self, rec: DiskRecord) -> PrefixEntry | None:
        """The entry of `rec`, or None (with a warning; a file of ours that cannot be trusted is
        removed) when it cannot be read."""
        try:
            caches, meta = read_caches(rec.path, self.fingerprint, self.budget_bytes)
            again = record_of(rec.path, meta, rec.nbytes, rec.last_used)
            if not np.array_equal(again.tokens, rec.tokens) or again.checkpoints != rec.checkpoints:
                raise EntryRejected(EntryProblem.MISMATCH, "it changed since it was listed")
            local = self.trimmable[: self._local]
            layers, rest = caches[: self._local], caches[self._local :]
            width = sum(not t for t in local)
            if len(layers) != self._local or len(rest) != width * len(rec.checkpoints):
                raise EntryRejected(EntryProblem.MALFORMED, "its layers do not match the model's")
            checkpoints = {
                p: rest[i * width : (i + 1) * width] for i, p in enumerate(rec.checkpoints)
            }
        except EntryRejected as exc:  # never a failed request, never a wrong token
            log.warning("prefix cache: skipping entry %s (%s)", ascii(rec.path.name), exc.why)
            self._reject(rec.path, exc)  # (the file removed if it is one of ours)
            self._forget(rec.key, unlink=False)
            if self.remote is not None:  # the other ranks' parts of it go too
                self.remote.forget(rec.key)
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
        entry = PrefixEntry(rec.tokens.copy(), layers, checkpoints, key=rec.key, scope=rec.scope)
        self.loads += 1
        return entry

    # ---- writing ------------------------------------------------------------------------------
    def write(self, entry: PrefixEntry) -> None:
        """Queue `entry` for the writer (its arrays are evaluated: the writer only reads them)."""
        if self.usable and entry.nbytes <= self.budget_bytes:
            self._queue.put(entry)

    def engine_is(self, activity: Activity) -> None:
        self._queue.engine_is(activity)

    def write_now(self) -> None:
        self._queue.write_now()

    def _write_and_publish(self, entry: PrefixEntry, epoch: int) -> None:
        self._write(entry, epoch)
        self.on_written()

    def _write(self, entry: PrefixEntry, epoch: int) -> None:
        final = self.dir / (entry.key + SUFFIX)
        positions = sorted(entry.checkpoints)
        # This process's layers only: the followers' element (a pipeline's) writes its own.
        caches = list(entry.layers[: self._local]) + [
            c for p in positions for c in entry.checkpoints[p] if not isinstance(c, RemoteLayers)
        ]
        meta = {
            "tokens": base64.b64encode(np.asarray(entry.tokens, dtype="<i4").tobytes()).decode(),
            "checkpoints": json.dumps(positions),
            "scope": entry.scope,
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
        rec = DiskRecord(
            entry.key, final, entry.tokens, tuple(positions), size, time.time(), entry.scope
        )
        with self._lock:
            if epoch != self._queue.epoch:  # a clear came while it was written
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
        return (
            old.key != new.key
            and old.scope == new.scope
            and covers(new.tokens, new.checkpoints, old.tokens, old.checkpoints, self.trimmable)
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
        self._queue.drop()
        with self._lock:
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
            "disk_rejected": {p.value: n for p, n in sorted(self.rejected.items())},
        }

    def flush(self, timeout: float = 30.0) -> None:
        """Wait until every queued entry is written (tests, and a clean shutdown)."""
        self._queue.flush(timeout)

    def close(self) -> None:
        self._queue.close()


def clear_folder(directory: Path) -> int:
    """Remove every entry file of a folder (no tier open on it); returns the bytes removed. Links
    and other non-files are removed as names, never followed."""
    removed = 0
    try:
        paths = list(Path(directory).rglob("*" + SUFFIX))  # a pipeline's ranks: a folder each
    except OSError:
        return 0
    others = Path(directory) / MODELS_FOLDER  # the other models' folders are theirs to clear
    for path in paths:
        if path.is_relative_to(others):
            continue
        try:
            size = path.lstat().st_size
            path.unlink()
            removed += size
        except OSError:
            pass
    return removed
