"""When the SSD tier writes: a queue of entries and a thread of its own, kept out of time to
first token.

The engine tells the queue what it is doing (`Activity`): while a row reads its prompt, queued
entries wait (at most HOLD_MAX_S each, and never while HOLD_QUEUE of them wait: a server always
reading some prompt still writes them); while rows only decode, they are written at once; on an
idle engine, once it has been idle for QUIET_S (an agent's next turn often follows its answer at
once, and a write started then shares the prefill's cores and GIL). An entry queued behind one
that it covers (a row's whole generation after its prompt) replaces it, so a short turn is
written once. Measured on a 2-core machine, a prefix-hit turn's first token came 14 ms later (of
100) while its prompt's entry was written beside it.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from moed.daemon.engine.prefix_cache.entry import PrefixEntry, covers

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


class WriteQueue:
    """Entries waiting to be written, and the thread that writes them with `write(entry,
    epoch)`: `epoch` counts the drops (a clear) before the entry left the queue, so a write
    begun before a clear is not kept after it."""

    def __init__(
        self, write: Callable[[PrefixEntry, int], None], trimmable: tuple[bool, ...]
    ) -> None:
        self._write = write
        self._trimmable = trimmable
        self._wake = threading.Condition()
        self._pending: deque[tuple[PrefixEntry, float]] = deque()  # (entry, when queued)
        self._activity, self._idle_since = Activity.IDLE, time.monotonic()
        self._closing = False
        self.epoch = 0  # drops so far (read under the tier's lock: a plain int the queue bumps)
        self._flushing = 0  # callers of flush(): the queue is written whatever the hold
        self._urgent = 0  # memory is short: this many of the first queued go out now
        self._unfinished = 0  # queued or being written
        self._writer = threading.Thread(
            target=self._write_loop, name="moed-prefix-ssd", daemon=True
        )
        self._writer.start()

    def put(self, entry: PrefixEntry) -> None:
        """Queue `entry` (its arrays are evaluated: the writer only reads them)."""
        with self._wake:
            if self._closing:
                return
            kept: list[tuple[PrefixEntry, float]] = []
            since = time.monotonic()
            for e, t in self._pending:  # the ones `entry` covers leave: it is written instead
                if e.scope == entry.scope and covers(
                    entry.tokens, entry.checkpoints, e.tokens, e.checkpoints, self._trimmable
                ):
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

    def drop(self) -> None:
        """Forget every queued entry (a clear); one being written is not kept (its epoch)."""
        with self._wake:
            self._unfinished -= len(self._pending)
            self._pending.clear()
            self._urgent = 0
            self.epoch += 1
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

    def _next_entry(self) -> tuple[PrefixEntry, int] | None:
        """The next entry to write once the engine allows it, with the epoch it left the queue
        in; None when closing with none left."""
        with self._wake:
            while True:
                if self._pending:
                    wait = self._wait_s(self._pending[0][1], time.monotonic())
                    if wait <= 0:
                        self._urgent = max(0, self._urgent - 1)
                        return self._pending.popleft()[0], self.epoch
                    self._wake.wait(wait)
                elif self._closing:
                    return None
                else:
                    self._wake.wait()

    def _write_loop(self) -> None:
        while (item := self._next_entry()) is not None:
            try:
                self._write(*item)
            except Exception:  # a bug here must not kill the writer silently
                log.exception("prefix cache: SSD write failed")
            finally:
                # Not held while the next one is awaited: its arrays (a pipeline's twin lists
                # in the other ranks too) go with the memory tier's copy.
                item = None
                with self._wake:
                    self._unfinished -= 1
                    self._wake.notify_all()

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
