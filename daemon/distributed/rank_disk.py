"""The prefix cache's SSD tier under a pipeline: every rank keeps files of its own layers of each
entry, in a folder of its own, and rank 0 decides everything.

Rank 0's SSD tier (engine/prefix_cache/disk_tier.py) holds the index (tokens, checkpoints, least
recently used order) and its own layers; through `LeaderDisk` it tells the followers, as cache
ops carried by the next step (cache_ops.py), to write their part of an entry it has written
(so their writes wait out a prefill as its own do), to remove the part of one it lets go, and to
clear. A follower's `FollowerDisk` writes on a thread of its own, atomically, fingerprinted and
checksummed like rank 0's files (model/cache_file.py). On a hit from the SSD rank 0 asks every
rank to read its part (one PREFIX_LOAD step, answered by all): a rank that cannot (a missing,
corrupt or foreign file, another host's folder that cannot be used) makes it a miss with a
warning, never a wrong token. The files survive restarts of the group.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections import deque
from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from mlx_lm.models.cache import make_prompt_cache

from moed.daemon.distributed.cache_ops import CacheOp, key_words
from moed.daemon.distributed.failure import outside_a_step
from moed.daemon.model.cache_file import (
    SUFFIX,
    entry_files,
    model_fingerprint,
    read_caches,
    unlink,
    write_caches,
)
from moed.daemon.model.entry_file import EntryRejected
from moed.daemon.model.layer_caches import LayerCache

if TYPE_CHECKING:  # types only: the leader imports this module's users
    from moed.daemon.distributed.leader import PipelineLeader
    from moed.daemon.distributed.rank_model import RankModel

log = logging.getLogger("moed.prefix_cache")


class _Action(enum.Enum):
    """What a follower's writer does next, in the order rank 0 asked."""

    WRITE = "write"
    FORGET = "forget"
    CLEAR = "clear"


WRITE_QUEUE = 16  # actions waiting for a follower's writer; a write beyond is dropped (advisory)
SLACK = 2.0  # a follower keeps up to this many times its share: rank 0's evictions decide first


def rank_disk_place(base: Path, model_path: Path, rank: RankModel) -> tuple[Path, str]:
    """A rank's folder under the SSD tier's and the fingerprint of its files (its layers)."""
    layers = rank.layers
    classes = [type(c).__name__ for c in make_prompt_cache(rank.model)]
    part = f"rank {layers.rank}/{layers.size} layers {layers.start}-{layers.end}"
    folder = Path(base) / f"rank{layers.rank}of{layers.size}"
    return folder, model_fingerprint(model_path, classes, part)


class PersistedEntry(Protocol):
    """What the followers' part of an SSD write reads of a prefix cache entry (the engine's
    PrefixEntry answers it: engine/ is above this room)."""

    @property
    def key(self) -> str: ...

    @property
    def layers(self) -> list[LayerCache]: ...  # the last: the followers' layers' handle

    @property
    def checkpoints(self) -> Mapping[int, list[LayerCache]]: ...


class LeaderDisk:
    """Rank 0's side: what its SSD tier does to an entry, the followers do to their part."""

    def __init__(self, leader: PipelineLeader):
        self._leader = leader
        self._states = not leader.cache_trimmable()[-1]  # followers keep recurrent state

    def persist(self, entry: PersistedEntry) -> None:
        handle = entry.layers[-1]
        states: list[int] = []
        if self._states:  # else a checkpoint list holds only rank 0's own layers' states
            states = [entry.checkpoints[p][-1].handle for p in sorted(entry.checkpoints)]
        self._leader.record(
            CacheOp.PERSIST, *key_words(entry.key), handle.handle, len(states), *states
        )

    def forget(self, key: str) -> None:
        self._leader.record(CacheOp.FORGET, *key_words(key))

    def clear(self) -> None:
        self._leader.record(CacheOp.CLEAR_DISK)

    def load(self, key: str, positions: tuple[int, ...]) -> tuple[Any, list[Any]] | None:
        n_states = len(positions) if self._states else 0
        load = partial(self._leader.load_prefix, key_words(key), n_states)
        return outside_a_step("prefix load", load, log)  # a rank gone: a miss here


class FollowerDisk:
    """A follower's files of its layers: written, removed and cleared in the order rank 0 asked
    (one writer thread), read on the follower's own thread."""

    def __init__(
        self, directory: Path, budget_bytes: int, fingerprint: str, trimmable: tuple[bool, ...]
    ):
        self.dir = Path(directory)
        self.budget_bytes = budget_bytes
        self.fingerprint = fingerprint
        self._width = sum(not t for t in trimmable)  # a checkpoint's layers
        self._layers = len(trimmable)
        self.writes = self.write_errors = self.loads = self.load_errors = self.evictions = 0
        self._lock = threading.Lock()  # the sizes: the writer changes them, status reads them
        self._sizes: dict[str, int] = {}
        self._usable = self._scan()
        self._wake = threading.Condition()
        self._queue: deque[tuple[_Action, str, list, list]] = deque()  # action, key, layers, states
        self._closing = False
        self._writer = threading.Thread(target=self._run, name="moed-rank-ssd", daemon=True)
        self._writer.start()

    def _scan(self) -> bool:
        try:
            paths = entry_files(self.dir)
        except OSError as exc:
            log.warning("prefix cache: cannot use %s (%s); no SSD tier on this rank", self.dir, exc)
            return False
        for path in paths:
            try:
                self._sizes[path.stem] = path.lstat().st_size  # before the writer starts
            except OSError:
                pass
        return True

    # ---- what rank 0's ops ask (the follower's step thread) ---------------------------------
    def write(self, key: str, layers: list[LayerCache], states: list[list[LayerCache]]) -> None:
        with self._wake:
            if not self._usable or self._closing:
                return
            if sum(a is _Action.WRITE for a, *_ in self._queue) >= WRITE_QUEUE:
                log.debug("prefix cache: this rank's SSD writer is busy; %s not written", key)
                return
            self._queue.append((_Action.WRITE, key, layers, states))
            self._wake.notify_all()

    def forget(self, key: str) -> None:
        with self._wake:
            self._queue.append((_Action.FORGET, key, [], []))
            self._wake.notify_all()

    def clear(self) -> None:
        with self._wake:
            self._queue.clear()  # what was queued before goes with everything else
            self._queue.append((_Action.CLEAR, "", [], []))
            self._wake.notify_all()

    def load(self, key: str, n_states: int) -> tuple[list, list[list]] | None:
        """This rank's part of `key`: its layers and `n_states` checkpoints' states, or None."""
        with self._wake:
            for action, queued, layers, states in reversed(self._queue):
                if queued == key:  # not written yet: the arrays rank 0 asked to write are here
                    if action is _Action.WRITE and len(states) == n_states:
                        return list(layers), [list(s) for s in states]
                    break
        path = self.dir / (key + SUFFIX)
        try:
            caches, _ = read_caches(path, self.fingerprint, int(self.budget_bytes * SLACK))
            layers, rest = caches[: self._layers], caches[self._layers :]
            if len(layers) != self._layers or len(rest) != self._width * n_states:
                raise ValueError("its layers do not match this rank's")
        except Exception as exc:  # missing, corrupt, foreign: rank 0 makes it a miss, forgets it
            self.load_errors += 1
            # The reason only (EntryRejected's is a fixed sentence): nothing of the file's.
            why = exc.why if isinstance(exc, EntryRejected) else type(exc).__name__
            log.warning("prefix cache: this rank cannot read %s (%s)", ascii(path.name), why)
            return None
        self.loads += 1
        w = self._width
        return layers, [rest[i * w : (i + 1) * w] for i in range(n_states)]

    # ---- the writer thread ------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._queue and not self._closing:
                    self._wake.wait()
                if not self._queue:
                    return
                action, key, layers, states = self._queue.popleft()
            try:
                if action is _Action.WRITE:
                    self._write(key, layers, states)
                elif action is _Action.FORGET:
                    unlink(self.dir / (key + SUFFIX))
                    with self._lock:
                        self._sizes.pop(key, None)
                else:
                    with self._lock:
                        keys, self._sizes = list(self._sizes), {}
                    for k in keys:
                        unlink(self.dir / (k + SUFFIX))
            except Exception:  # a bug here must not kill the writer silently
                log.exception("prefix cache: this rank's SSD %s failed", action.value)
            finally:
                layers = states = []  # not held while the next is awaited (rank 0 dropped them)

    def _write(self, key: str, layers: list, states: list[list]) -> None:
        caches = list(layers) + [c for s in states for c in s]
        try:
            size = write_caches(self.dir / (key + SUFFIX), caches, self.fingerprint, {})
        except (OSError, RuntimeError, ValueError) as exc:  # full disk, read-only folder, ...
            self.write_errors += 1
            if self.write_errors == 1:
                log.warning("prefix cache: this rank cannot write to %s (%s)", self.dir, exc)
            return
        with self._lock:
            self._sizes[key] = size
        self.writes += 1
        self._enforce_budget()

    def _enforce_budget(self) -> None:
        """A backstop: rank 0's evictions normally keep this folder within its share."""
        with self._lock:
            sizes = dict(self._sizes)
        total = sum(sizes.values())
        if total <= self.budget_bytes * SLACK:
            return
        by_age = []
        for k in sizes:
            try:
                by_age.append(((self.dir / (k + SUFFIX)).lstat().st_mtime, k))
            except OSError:
                by_age.append((0.0, k))
        for _, k in sorted(by_age):
            if total <= self.budget_bytes:
                break
            unlink(self.dir / (k + SUFFIX))
            with self._lock:
                self._sizes.pop(k, None)
            total -= sizes[k]
            self.evictions += 1

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            entries, total = len(self._sizes), sum(self._sizes.values())
        return {
            "disk_dir": str(self.dir),
            "disk_entries": entries,
            "disk_bytes": total,
            "disk_writes": self.writes,
            "disk_write_errors": self.write_errors,
            "disk_loads": self.loads,
            "disk_load_errors": self.load_errors,
            "disk_evictions": self.evictions,
        }

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued (a clean stop keeps its entries), then stop."""
        with self._wake:
            self._closing = True
            self._wake.notify_all()
        self._writer.join(timeout)
