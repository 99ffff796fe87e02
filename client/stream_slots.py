"""The generations one connection has open in the daemon, held to the daemon's limit per
connection (its welcome's `limits.max_pending_per_client`).

The gateway serves many HTTP requests over one connection; past the daemon's limit a generation
waits here for a slot instead of being refused as `overloaded`. A generation the caller left holds
its slot until the daemon has ended it (its `done` or `error`), since until then the daemon still
counts it.

Fair across the callers behind the connection (a lane: the request's principal and caller): the
last sixteenth of the slots (one of the daemon's default 16; none below 16) is kept for lanes that
hold none, so a caller that arrives beside a busy one reaches the daemon at once (whose rows then
go in turn), and a freed slot goes to the waiting lane that holds the fewest, the first to wait
among equals.
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass

RESERVED_SHARE = 16  # a sixteenth of the slots: only a lane holding none may take them


@dataclass(frozen=True)
class SlotTicket:
    connection: int  # the connection it was taken on (a reset frees every slot)
    lane: str


class StreamSlots:
    def __init__(self) -> None:
        self.limit: int | None = None  # None: the daemon named no limit
        self.held = 0
        self.connection = 0  # counts resets: a slot taken on a dropped connection is not held
        self._held_by: collections.Counter[str] = collections.Counter()
        self._waiters: dict[str, collections.deque[asyncio.Future[SlotTicket]]] = {}
        self._order: collections.deque[str] = collections.deque()  # lanes waiting, first first

    def reset(self, limit: int | None) -> None:
        """A new connection: nothing is held there, and waiters may go (and find out)."""
        self.limit = limit
        self.held = 0
        self._held_by.clear()
        self.connection += 1
        self._wake()

    async def acquire(self, lane: str = "") -> SlotTicket:
        """Wait for a slot for `lane`; the returned ticket gives it back (`release`). A lane's
        generations take slots in the order they asked."""
        if self._may_take(lane) and lane not in self._waiters:
            return self._take(lane)
        waiter: asyncio.Future[SlotTicket] = asyncio.get_running_loop().create_future()
        if lane not in self._waiters:
            self._waiters[lane] = collections.deque()
            self._order.append(lane)
        self._waiters[lane].append(waiter)
        try:
            return await waiter  # the slot is handed over with the ticket (_wake)
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self.release(waiter.result())  # handed over, then cancelled: the next one's
            else:
                self._forget(lane, waiter)
            raise

    def release(self, ticket: SlotTicket) -> None:
        if ticket.connection == self.connection:
            self.held -= 1
            self._held_by[ticket.lane] -= 1
            if not self._held_by[ticket.lane]:
                del self._held_by[ticket.lane]
            self._wake()

    def _take(self, lane: str) -> SlotTicket:
        self.held += 1
        self._held_by[lane] += 1
        return SlotTicket(self.connection, lane)

    def _may_take(self, lane: str) -> bool:
        if self.limit is None:
            return True
        room = self.limit - self.held
        return room > (self.limit // RESERVED_SHARE if self._held_by[lane] else 0)

    def _forget(self, lane: str, waiter: asyncio.Future[SlotTicket]) -> None:
        queue = self._waiters.get(lane)
        if queue is None:
            return
        if waiter in queue:
            queue.remove(waiter)
        if not queue:
            del self._waiters[lane]
            self._order.remove(lane)

    def _wake(self) -> None:
        """Hand free slots to waiters: the waiting lane that holds the fewest first, the first
        to wait among equals."""
        while self._order:
            ranked = sorted(self._order, key=lambda lane: self._held_by[lane])  # stable
            lane = next((lane for lane in ranked if self._may_take(lane)), None)
            if lane is None:
                return
            waiter = self._waiters[lane].popleft()
            if not self._waiters[lane]:
                del self._waiters[lane]
                self._order.remove(lane)
            if not waiter.done():  # else its caller left meanwhile
                waiter.set_result(self._take(lane))
