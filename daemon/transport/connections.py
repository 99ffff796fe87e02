"""Client connections counted from the ROUTER's own monitor (accepted minus disconnected).

libzmq aborts the whole process when it cannot accept a connection for want of a descriptor, so
the daemon refuses the handshake (`hello`) of connections past `max_connections` with the typed,
retryable `overloaded`; a refused client closes its connection and the count falls again. The
default limit is what the raised open-file limit leaves beside the daemon's own files.
"""

from __future__ import annotations

import logging
import threading

import zmq
from zmq.utils.monitor import recv_monitor_message

from moed.daemon.ground.open_files import current as open_file_limit
from moed.protocol import ErrorCode, ProtocolError

log = logging.getLogger("moed.transport")

_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED


def connection_limit(configured: int) -> int:
    """`max_connections` as configured, or (0) what the open-file limit has room for."""
    return configured or open_file_limit().connection_room


class ConnectionCount:
    def __init__(self, router: zmq.Socket[bytes], limit: int):
        self._owner = threading.get_ident()  # zmq sockets belong to one thread: the transport's
        self.limit = limit
        self.live = 0
        self.refused = 0
        self.monitor = router.get_monitor_socket(_EVENTS)

    def drain(self) -> None:
        """Read every pending monitor event (the poller calls this when the monitor is readable).
        From another thread (the metrics HTTP server renders the status there) it reads nothing:
        the counts are then as of the transport's last drain."""
        if threading.get_ident() != self._owner:
            return
        while True:
            try:
                event = recv_monitor_message(self.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            if event["event"] == zmq.EVENT_ACCEPTED:
                self.live += 1
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                self.live = max(0, self.live - 1)

    def admit_hello(self) -> None:
        """Raise `overloaded` when the connections are past the limit (the newest is counted)."""
        self.drain()
        if self.live > self.limit:
            self.refused += 1
            if self.refused == 1 or self.refused % 1000 == 0:
                log.warning(
                    "%d client connections, over max_connections %d: refusing new handshakes "
                    "(%d refused so far)",
                    self.live,
                    self.limit,
                    self.refused,
                )
            raise ProtocolError(
                ErrorCode.OVERLOADED,
                f"the daemon has {self.live} client connections, at most {self.limit} "
                "(max_connections); close some, then retry",
            )

    def describe(self) -> dict[str, int]:
        return {"connections": self.live, "max_connections": self.limit}

    def close(self) -> None:
        self.monitor.close(linger=0)
