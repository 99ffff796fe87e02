"""The gateway's connections, guarded below HTTP (uvicorn's protocol class, subclassed): headers
must arrive within a deadline and a size, and the open connections are capped in all and per
client address. At a cap, the oldest connection that has no request in flight (still sending its
headers, or idle between requests) is closed to make room, so connections that trickle headers
cannot keep a real request, or /health, out."""

from __future__ import annotations

import asyncio
import collections

from uvicorn.protocols.http.auto import AutoHTTPProtocol

from .config import ConnectionLimits

_TIMEOUT = b"HTTP/1.1 408 Request Timeout\r\nconnection: close\r\ncontent-length: 0\r\n\r\n"
_TOO_LARGE = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
    b"connection: close\r\ncontent-length: 0\r\n\r\n"
)


class ConnectionTable:
    """Open connections, oldest first, shared by every connection's protocol object."""

    def __init__(self, limits: ConnectionLimits):
        self.limits = limits
        self.open: dict[GuardedProtocol, None] = {}  # insertion order is age
        self.per_client: collections.Counter[str] = collections.Counter()

    def admit(self, conn: GuardedProtocol) -> bool:
        """Whether `conn` may stay, after closing idle connections to make room."""
        peer = conn.peer
        if self.per_client[peer] >= self.limits.max_open_per_client and not self._evict(peer):
            return False
        if len(self.open) >= self.limits.max_open and not self._evict(None):
            return False
        self.open[conn] = None
        self.per_client[peer] += 1
        return True

    def remove(self, conn: GuardedProtocol) -> None:
        if self.open.pop(conn, False) is None:
            self.per_client[conn.peer] -= 1
            if not self.per_client[conn.peer]:
                del self.per_client[conn.peer]

    def _evict(self, peer: str | None) -> bool:
        for conn in self.open:
            if conn.idle and (peer is None or conn.peer == peer):
                self.remove(conn)
                conn.transport.close()
                return True
        return False


def guarded_protocol(table: ConnectionTable) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class bound to `table` (pass it as uvicorn's `http`)."""
    return type("GuardedProtocol", (GuardedProtocol,), {"table": table})


class GuardedProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
    table: ConnectionTable

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        self.peer = self.client[0] if self.client else "?"
        self._seen_cycle = None
        self._header_bytes = 0
        self._header_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        if not self.table.admit(self):
            transport.close()
            return
        self._await_headers()

    @property
    def idle(self) -> bool:
        """No request in flight: still sending headers, or between requests."""
        return self.cycle is None or self.cycle.response_complete

    def data_received(self, data: bytes) -> None:
        awaiting = self._header_timer is not None
        super().data_received(data)
        if awaiting:
            if self.cycle is not None and self.cycle is not self._seen_cycle:
                self._headers_done()
            else:
                self._header_bytes += len(data)
                if self._header_bytes > self.table.limits.max_header_bytes:
                    self._refuse(_TOO_LARGE)
        self._watch_body()

    def _watch_body(self) -> None:
        """While a body is coming, each piece must follow the last within `body_idle_s`."""
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        cycle = self.cycle
        if cycle is not None and cycle.more_body and not cycle.response_complete:
            self._body_timer = self.loop.call_later(self.table.limits.body_idle_s, self._body_idle)

    def _body_idle(self) -> None:
        # The app is waiting for the body: closing ends its receive with a disconnect.
        started = self.cycle is not None and self.cycle.response_started
        self._refuse(b"" if started else _TIMEOUT)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.transport.is_closing():
            return
        if self.cycle is not None and self.cycle is not self._seen_cycle:
            self._headers_done()  # a pipelined request's headers were already waiting
            return
        self._await_headers()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timer()
        self.table.remove(self)
        super().connection_lost(exc)

    def _await_headers(self) -> None:
        self._seen_cycle = self.cycle
        self._header_bytes = 0
        self._cancel_timer()
        self._header_timer = self.loop.call_later(
            self.table.limits.header_timeout_s, self._refuse, _TIMEOUT
        )

    def _headers_done(self) -> None:
        self._seen_cycle = self.cycle
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _cancel_timer(self) -> None:
        for timer in (self._header_timer, self._body_timer):
            if timer is not None:
                timer.cancel()
        self._header_timer = self._body_timer = None

    def _refuse(self, answer: bytes) -> None:
        self._cancel_timer()
        if not self.transport.is_closing():
            self.transport.write(answer)
            self.transport.close()
