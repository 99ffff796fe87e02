"""Batched KV caches kept in lockstep across ranks: rank 0 records, the followers replay.

mlx-lm's BatchGenerator builds, merges, extends, pads, copies and filters its batched caches by
calling the same method on every per-layer cache of a list. Rank 0's lists end with one extra
element, a `CacheHandle`, that takes part in every such call: it turns each call into one op in
an ordered log, and the next step carries the log to the followers, which apply the same calls to
their own layers' caches. Every rank then holds the same batch layout (rows, left padding), so a
batched step is one forward through the ranks and exactly the single-process computation.
Models never see the handle: the leader strips it before the forward (and zip stops at the last
layer anyway).
"""

from __future__ import annotations

import copy
import enum
import itertools
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from moed.daemon.distributed.protocol import ProtocolMismatch
from moed.daemon.model.layer_caches import own_arrays, resume_layers, trimmable_layers

if TYPE_CHECKING:  # types only: rank_disk.py records these ops
    from moed.daemon.distributed.rank_disk import FollowerDisk

_NONE = -1  # an absent optional list in PREPARE


class CacheOp(enum.IntEnum):
    RELEASE = 1  # handle: rank 0 dropped this cache list
    MERGE = 2  # new, n, handles...: a batch of the n sequences' caches (rows in that order)
    EXTEND = 3  # a, b: append b's rows to a (in place)
    FILTER = 4  # handle, n, rows...: keep these rows (in place)
    PREPARE = 5  # handle, then left_padding, lengths, right_padding: each n, values... or -1
    FINALIZE = 6  # handle: apply the padding PREPARE announced
    COPY = 7  # new, old: a deep copy
    # The prefix cache's (engine/prefix_cache/): each rank keeps its own layers of an entry.
    EXTRACT = 8  # new, batch, row: that row's caches, on their own
    EXTRACT_STATE = 9  # new, batch, row: that row's untrimmable layers (a checkpoint)
    OWN = 10  # handle: evaluate its arrays into buffers of their own (an entry keeps it)
    RESUME = 11  # new, whole, length, state or -1: fresh caches at length (layer_caches.py)
    # The SSD tier's (distributed/rank_disk.py): each rank keeps files of its own layers.
    PERSIST = 12  # key (KEY_WORDS), handle, n, states...: write that entry's part
    FORGET = 13  # key: remove it
    CLEAR_DISK = 14  # remove every file
    LOAD = 15  # new, key, n, new states...: read it into these handles (see take_load_result)


KEY_WORDS = 8  # an entry's key (32 hex digits) as 16-bit words: every op argument is an int32


def key_words(key: str) -> list[int]:
    if len(key) != 4 * KEY_WORDS:
        raise ValueError(f"a prefix entry key has {4 * KEY_WORDS} hex digits, not {len(key)}")
    return [int(key[i : i + 4], 16) for i in range(0, len(key), 4)]


def key_of(words: list[int]) -> str:
    return "".join(f"{w:04x}" for w in words)


class OpLog:
    """Rank 0's ordered cache operations since the last step (appended from any thread: a
    RELEASE comes from a finalizer, always after the ops that used the cache)."""

    def __init__(self) -> None:
        self._ops: deque[list[int]] = deque()
        self._handles = itertools.count(1)
        self.live = 0  # cache lists made and not yet dropped (the followers hold as many)

    def new_handle(self) -> CacheHandle:
        handle = CacheHandle(next(self._handles), self)
        self.live += 1
        weakref.finalize(handle, self._release, handle.handle)
        return handle

    def _release(self, handle: int) -> None:
        self.live -= 1
        self.record(CacheOp.RELEASE, handle)

    def record(self, op: CacheOp, *args: int) -> None:
        self._ops.append([int(op), *(int(a) for a in args)])

    @property
    def pending(self) -> bool:
        return bool(self._ops)

    def drain(self) -> tuple[int, ...]:
        out: list[int] = []
        while self._ops:
            out += self._ops.popleft()
        return tuple(out)


class CacheHandle:
    """The last element of rank 0's cache lists: names the followers' twin of the list. Answers
    every call mlx-lm's BatchGenerator makes on a layer cache (model/mlx_compat.py, use 4)."""

    def __init__(self, handle: int, log: OpLog | None):
        self.handle = handle  # 0: a detached copy (extract) that no follower holds
        self._log = log

    def _record(self, op: CacheOp, *args: int) -> None:
        if self._log is None:
            raise ValueError("this cache was extracted from a pipeline batch and has no twin")
        self._log.record(op, *args)

    @classmethod
    def merge(cls, handles: list[CacheHandle]) -> CacheHandle:
        merged = handles[0]._log.new_handle()
        merged._record(CacheOp.MERGE, merged.handle, len(handles), *(h.handle for h in handles))
        return merged

    def extend(self, other: CacheHandle) -> None:
        self._record(CacheOp.EXTEND, self.handle, other.handle)

    def filter(self, batch_indices) -> None:
        rows = [int(i) for i in batch_indices]
        self._record(CacheOp.FILTER, self.handle, len(rows), *rows)

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None) -> None:
        args: list[int] = [self.handle]
        for values in (left_padding, lengths, right_padding):
            if values is None:
                args.append(_NONE)
            else:
                values = [int(v) for v in values]
                args += [len(values), *values]
        self._record(CacheOp.PREPARE, *args)

    def finalize(self) -> None:
        self._record(CacheOp.FINALIZE, self.handle)

    def extract(self, idx: int) -> CacheHandle:
        """Row `idx` on its own (a finished row's cache, a prefix-cache entry): the followers
        slice theirs lazily, so a row nobody keeps costs them nothing."""
        row = self._log.new_handle() if self._log is not None else CacheHandle(0, None)
        if self._log is not None:
            self._record(CacheOp.EXTRACT, row.handle, self.handle, idx)
        return row

    # The prefix cache's operations (model/layer_caches.py's RemoteLayers).
    def extract_state(self, idx: int) -> CacheHandle:
        state = self._log.new_handle() if self._log is not None else CacheHandle(0, None)
        self._record(CacheOp.EXTRACT_STATE, state.handle, self.handle, idx)
        return state

    def own(self) -> None:
        self._record(CacheOp.OWN, self.handle)

    def resume(self, length: int, state: CacheHandle | None) -> CacheHandle:
        fresh = self._log.new_handle() if self._log is not None else CacheHandle(0, None)
        self._record(
            CacheOp.RESUME,
            fresh.handle,
            self.handle,
            length,
            _NONE if state is None else state.handle,
        )
        return fresh

    def __deepcopy__(self, memo) -> CacheHandle:
        twin = self._log.new_handle()
        twin._record(CacheOp.COPY, twin.handle, self.handle)
        return twin

    # The rest of the cache interface that list-wide code touches.
    @property
    def state(self) -> list:
        return []

    @property
    def nbytes(self) -> int:
        return 0

    def empty(self) -> bool:
        return True

    def size(self) -> int:
        return 0


class MirroredCaches:
    """A follower's cache lists by handle, changed only by rank 0's ops."""

    def __init__(self, make_cache: Callable[[], list], disk: FollowerDisk | None = None):
        self._make = make_cache
        self._lists: dict[int, list] = {}
        self._trimmable = trimmable_layers(make_cache())  # which layers can be cut back
        self._states: set[int] = set()  # lists that hold only the untrimmable layers
        self._disk = disk  # this rank's SSD files of its layers, or None
        self._load_failed = False  # a LOAD since the last take_load_result could not read

    def take_load_result(self) -> bool:
        """Whether every LOAD since the last call read its entry (rank 0 asks after them)."""
        ok, self._load_failed = not self._load_failed, False
        return ok

    def __len__(self) -> int:
        return len(self._lists)

    def get(self, handle: int) -> list:
        """The list under `handle`; a fresh one the first time (rank 0 made it without a step)."""
        found = self._lists.get(handle)
        if found is None:
            found = self._lists[handle] = self._make()
        return found

    def apply(self, ops: tuple[int, ...]) -> None:
        it = iter(ops)
        for code in it:
            try:
                op = CacheOp(code)
            except ValueError:
                raise ProtocolMismatch(f"unknown cache op {code} (different versions?)") from None
            if op is CacheOp.RELEASE:
                handle = next(it)
                self._lists.pop(handle, None)
                self._states.discard(handle)
            elif op is CacheOp.MERGE:
                new, n = next(it), next(it)
                parts = [self.get(next(it)) for _ in range(n)]
                self._lists[new] = [layer[0].merge(list(layer)) for layer in zip(*parts)]
            elif op is CacheOp.EXTEND:
                a, b = self.get(next(it)), self.get(next(it))
                for ca, cb in zip(a, b):
                    ca.extend(cb)
            elif op is CacheOp.FILTER:
                caches, n = self.get(next(it)), next(it)
                rows = [next(it) for _ in range(n)]
                for c in caches:
                    c.filter(rows)
            elif op is CacheOp.PREPARE:
                caches = self.get(next(it))
                left, lengths, right = (_optional(it) for _ in range(3))
                for c in caches:
                    c.prepare(left_padding=left, lengths=lengths, right_padding=right)
            elif op is CacheOp.FINALIZE:
                for c in self.get(next(it)):
                    c.finalize()
            elif op is CacheOp.COPY:
                new, old = next(it), next(it)
                self._lists[new] = copy.deepcopy(self.get(old))
            elif op is CacheOp.EXTRACT:
                new, batch, row = next(it), next(it), next(it)
                self._lists[new] = [c.extract(row) for c in self.get(batch)]
            elif op is CacheOp.EXTRACT_STATE:
                new, batch, row = next(it), next(it), next(it)
                caches = zip(self.get(batch), self._trimmable)
                self._lists[new] = [c.extract(row) for c, cut in caches if not cut]
                self._states.add(new)
            elif op is CacheOp.OWN:
                own_arrays(self.get(next(it)))
            elif op is CacheOp.RESUME:
                new, whole, length, state = next(it), next(it), next(it), next(it)
                self._lists[new] = resume_layers(
                    self.get(whole), length, self._trimmable, self._state(state)
                )
            elif op is CacheOp.PERSIST:
                key = key_of([next(it) for _ in range(KEY_WORDS)])
                layers, n = self.get(next(it)), next(it)
                states = [self._state(next(it)) or [] for _ in range(n)]
                if self._disk is not None:
                    self._disk.write(key, layers, states)
            elif op is CacheOp.FORGET:
                key = key_of([next(it) for _ in range(KEY_WORDS)])
                if self._disk is not None:
                    self._disk.forget(key)
            elif op is CacheOp.CLEAR_DISK:
                if self._disk is not None:
                    self._disk.clear()
            elif op is CacheOp.LOAD:
                new = next(it)
                key = key_of([next(it) for _ in range(KEY_WORDS)])
                handles = [next(it) for _ in range(next(it))]
                self._load(new, key, handles)

    def _load(self, new: int, key: str, state_handles: list[int]) -> None:
        loaded = self._disk.load(key, len(state_handles)) if self._disk is not None else None
        if loaded is None:
            self._load_failed = True
            return
        layers, states = loaded
        self._lists[new] = layers
        for handle, state in zip(state_handles, states):
            self._lists[handle] = state
            self._states.add(handle)

    def _state(self, handle: int) -> list | None:
        """A checkpoint's untrimmable layers: a state list, or those of a whole row's list (an
        entry that an extending one absorbed keeps its whole row as a checkpoint)."""
        if handle == _NONE:
            return None
        found = self.get(handle)
        if handle in self._states:
            return found
        return [c for c, cut in zip(found, self._trimmable) if not cut]


def _optional(it: Iterator[int]) -> list[int] | None:
    n = next(it)
    return None if n == _NONE else [next(it) for _ in range(n)]
