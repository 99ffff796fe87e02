"""The generations one connection has open in the daemon, held to the daemon's limit per
connection (its welcome's `limits.max_pending_per_client`).

The gateway serves many HTTP requests over one connection; past the daemon's limit a generation
waits here for a slot instead of being refused as `overloaded`. A generation the caller left holds
its slot until the daemon has ended it (its `done` or `error`), since until then the daemon still
counts it.
"""

from __future__ import annotations

import asyncio
import collections


class StreamSlots:
    def __init__(self) -> None:
        self.limit: int | None = None  # None: the daemon named no limit
        self.held = 0
        self.connection = 0  # counts resets: a slot taken on a dropped connection is not held
        self._waiters: collections.deque[asyncio.Future] = collections.deque()

    def reset(self, limit: int | None) -> None:
        """A new connection: nothing is held there, and waiters may go (and find out)."""
        self.limit = limit
        self.held = 0
        self.connection += 1
        self._wake()

    async def acquire(self) -> int:
        """Wait for a slot; the returned ticket gives it back (`release`)."""
        while self.limit is not None and self.held >= self.limit:
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            except BaseException:
                # A waiter woken and then cancelled passes its turn on.
                if waiter.done() and not waiter.cancelled():
                    self._wake()
                raise
        self.held += 1
        return self.connection

    def release(self, ticket: int) -> None:
        if ticket == self.connection:
            self.held -= 1
            self._wake()

    def _wake(self) -> None:
        room = self.limit - self.held if self.limit is not None else len(self._waiters)
        while room > 0 and self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                room -= 1
