"""What the engine runs next: which waiting requests join the running batch this step.

The engine core asks `schedule()` at every token boundary and carries the answer out; it holds no
scheduling logic of its own. The batch itself (engine/batch.py) interleaves prefill chunks with
decode steps; the scheduler decides admission: how many rows (`max_batch`), whether their KV cache
fits the memory plan, and in which order clients get a row.
"""

from __future__ import annotations

import collections
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from moed.daemon.engine.request import RequestKey


@dataclass(frozen=True)
class Round:
    """One scheduling decision: the requests that join the running batch now, in this order."""

    admit: tuple[RequestKey, ...]


@dataclass(frozen=True)
class BatchLimits:
    max_batch: int  # rows in the running batch (prefilling and decoding)
    # KV rows the memory plan keeps room for. The batched cache pads every row to the longest,
    # so a batch of n rows whose longest may reach T tokens holds n * T.
    kv_tokens: int
    # An idle engine waits this long after a request arrives for others to start with it (as
    # one batch of one composition); 0 starts at once.
    window_s: float = 0.0


class Scheduler(Protocol):
    def add(
        self, key: RequestKey, client: bytes, kv_tokens: int, now: float, ready: bool = True
    ) -> None:
        """A request was accepted at `now` (monotonic) and waits for a row; one not `ready` (its
        grammar compiles) holds its place and is passed over until `ready(key)`."""

    def ready(self, key: RequestKey) -> None:
        """A waiting request may join the batch now (unknown keys are ignored)."""

    def remove(self, key: RequestKey) -> None:
        """A request ended (finished, cancelled or failed); unknown keys are ignored."""

    def schedule(self, now: float) -> Round:
        """The waiting requests that join the batch now (marked running); `now` is monotonic."""

    def wake_in(self, now: float) -> float | None:
        """Seconds until waiting requests may be admitted with nothing running; None: nothing
        running and none ready to (or some running: no wait)."""

    def newest(self) -> RequestKey | None:
        """The most recently accepted request still held (shed first under memory pressure)."""

    @property
    def running(self) -> int:
        """Requests in the running batch."""

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[RequestKey]: ...


class FairBatchScheduler:
    """Continuous batching with round-robin admission across clients.

    Each client has a FIFO of waiting requests; a free row goes to the waiting client with the
    fewest rows running, the first in turn among equals (a client served goes to the back of the
    line), so one client with many requests cannot starve the others, and a client that arrives
    beside a busy one gets the next free row. A client's turn goes to its first ready request
    (one whose grammar still compiles keeps its place; the client's later ready ones may go
    first). When the request in turn does not fit the KV budget, admission stops for this step (a
    large request waits for rows to drain rather than being overtaken for good); an empty batch
    always admits, as a lone request always ran.
    """

    def __init__(self, limits: BatchLimits) -> None:
        self.limits = limits
        self._waiting: dict[bytes, deque[_Waiting]] = {}
        self._first_wait: float | None = None  # when the oldest waiting request arrived
        self._turns: deque[bytes] = deque()  # clients with waiting requests, next turn first
        self._running: dict[RequestKey, int] = {}  # key -> its KV tokens
        self._all: dict[RequestKey, bytes] = {}  # every held request, in arrival order
        self._pending: set[RequestKey] = set()  # waiting, not ready yet
        self._rows: collections.Counter[bytes] = collections.Counter()  # rows running, by client

    @property
    def running(self) -> int:
        return len(self._running)

    def add(
        self, key: RequestKey, client: bytes, kv_tokens: int, now: float = 0.0, ready: bool = True
    ) -> None:
        self._all[key] = client
        if not self._turns:
            self._first_wait = now
        if client not in self._waiting:
            self._waiting[client] = deque()
            self._turns.append(client)
        self._waiting[client].append(_Waiting(key, kv_tokens))
        if not ready:
            self._pending.add(key)

    def ready(self, key: RequestKey) -> None:
        self._pending.discard(key)

    def remove(self, key: RequestKey) -> None:
        client = self._all.pop(key, None)
        self._pending.discard(key)
        if self._running.pop(key, None) is not None:
            assert client is not None  # a running key is held
            self._rows[client] -= 1
            if not self._rows[client]:
                del self._rows[client]
            return
        if client is None:
            return
        queue = self._waiting.get(client)
        if queue is not None:
            self._waiting[client] = deque(item for item in queue if item.key != key)
            if not self._waiting[client]:
                self._drop_client(client)

    def wake_in(self, now: float) -> float | None:
        if self._running or self._first_wait is None:
            return None
        if len(self._pending) == len(self._all):  # every waiting request still compiles
            return None
        return max(0.0, self._first_wait + self.limits.window_s - now)

    def schedule(self, now: float = 0.0) -> Round:
        admitted: list[RequestKey] = []
        ready = len(self._all) - len(self._running) - len(self._pending)
        if (self.wake_in(now) or 0.0) > 0 and ready < self.limits.max_batch:
            return Round(())  # gather the batch a little longer
        while len(self._running) < self.limits.max_batch:
            turn = self._next_turn()
            if turn is None:
                break
            client, item = self._turns[turn], self._next_ready(self._turns[turn])
            assert item is not None  # _next_turn chose a client with a ready request
            if not self._fits(item.kv_tokens):
                break
            queue = self._waiting[client]
            queue.remove(item)
            self._running[item.key] = item.kv_tokens
            self._rows[client] += 1
            admitted.append(item.key)
            del self._turns[turn]  # this client goes to the back of the line
            if queue:
                self._turns.append(client)
            else:
                del self._waiting[client]
        if not self._turns:
            self._first_wait = None
        return Round(tuple(admitted))

    def _next_ready(self, client: bytes) -> _Waiting | None:
        return next((w for w in self._waiting[client] if w.key not in self._pending), None)

    def _next_turn(self) -> int | None:
        """Where in _turns the client is whose ready request joins next: the fewest rows
        running, then the first in turn."""
        best: int | None = None
        for turn, client in enumerate(self._turns):
            if self._next_ready(client) is None:
                continue
            if best is None or self._rows[client] < self._rows[self._turns[best]]:
                best = turn
        return best

    def newest(self) -> RequestKey | None:
        return next(reversed(self._all), None)

    def _fits(self, kv_tokens: int) -> bool:
        if not self._running:
            return True
        longest = max(kv_tokens, *self._running.values())
        return (len(self._running) + 1) * longest <= self.limits.kv_tokens

    def _drop_client(self, client: bytes) -> None:
        del self._waiting[client]
        self._turns.remove(client)
        if not self._turns:
            self._first_wait = None

    def __len__(self) -> int:
        return len(self._all)

    def __iter__(self) -> Iterator[RequestKey]:
        return iter(tuple(self._all))


@dataclass(frozen=True)
class _Waiting:
    key: RequestKey
    kv_tokens: int
