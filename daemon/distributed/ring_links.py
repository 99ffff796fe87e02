"""The ring's TCP links, made by moed and proved with the group's secret before MLX uses them.

mx.distributed's ring backend listens on each of its ports and takes the first connection there
as its neighbour (mlx/distributed/ring/ring.cpp: bind, listen, accept once, no handshake), so
another local user who connected to a ring port the moment it opened (`ss -tln` shows it to
anyone) took the neighbour's place and the group failed to form (`[ring] Couldn't connect`).
Now the ring's published ports are moed's own listeners (LinkListeners, opened before the guard
names them): each rank connects to its right neighbour's and proves the secret (HMAC over fresh
nonces both ways, binding both ranks and the link's index), and accepts from its left neighbour
only a connection that proves it; anything else is dropped and the listener goes on listening.
The links are then handed to MLX in place of the ones its init made (ring_handoff.py).
"""

from __future__ import annotations

import hmac
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from moed.daemon.distributed.guard import (
    HANDSHAKE_S,
    MAX_PENDING,
    NONCE_BYTES,
    GuardRefused,
    mac,
    rank_bytes,
    recv_frame,
    send_frame,
)

log = logging.getLogger("moed.distributed")

LINK_MAGIC = b"moed-link-1"
_CLAIM = 4 + 4 + NONCE_BYTES + 32  # from rank, link index, nonce, tag


class LinkListeners:
    """A rank's ring ports, one listening socket per address of its hostfile entry: open before
    anyone learns them, and accepting until the left neighbour's proved link arrives."""

    def __init__(self, ips: tuple[str, ...] | list[str]):
        self.sockets = [socket.create_server((ip, 0), backlog=64) for ip in ips]

    @property
    def addresses(self) -> list[str]:
        return [f"{s.getsockname()[0]}:{s.getsockname()[1]}" for s in self.sockets]

    def close(self) -> None:
        for sock in self.sockets:
            try:  # shutdown first: a plain close leaves an accepting thread's call listening
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()


@dataclass
class RingLinks:
    """A rank's proved links: `left[i]` from its left neighbour to its own address i, `right[i]`
    to its right neighbour's address i (MLX's sockets_left_ and sockets_right_)."""

    left: list[socket.socket]
    right: list[socket.socket]

    def close(self) -> None:
        for sock in (*self.left, *self.right):
            sock.close()


def _address(text: str) -> tuple[str, int]:
    host, port = text.rsplit(":", 1)
    return host, int(port)


def form_links(
    rank: int,
    ring: list[list[str]],
    listeners: LinkListeners,
    secret: bytes,
    timeout_s: float = 60.0,
    failed: Callable[[], str | None] = lambda: None,
) -> RingLinks:
    """Connect to the right neighbour and accept from the left one, every link proved; raises
    GuardRefused when the neighbours do not show within `timeout_s` or `failed()` says why."""
    size = len(ring)
    left, right = (rank - 1) % size, (rank + 1) % size
    deadline = time.monotonic() + timeout_s
    accepting = [
        _Acceptor(sock, index, rank, left, secret) for index, sock in enumerate(listeners.sockets)
    ]
    try:
        outgoing = [
            _connect(_address(addr), rank, right, index, secret, deadline, failed)
            for index, addr in enumerate(ring[right])
        ]
        incoming = [a.wait(deadline, failed) for a in accepting]
    finally:
        listeners.close()  # the ring's published ports stop listening once its links are made
    return RingLinks(incoming, outgoing)


def _connect(
    address: tuple[str, int],
    rank: int,
    right: int,
    index: int,
    secret: bytes,
    deadline: float,
    failed: Callable[[], str | None],
) -> socket.socket:
    """This rank's link `index` to its right neighbour, retried until it is proved."""
    while True:
        try:
            return _claim(address, rank, right, index, secret)
        except (OSError, GuardRefused) as exc:
            why = failed()
            if why is not None or time.monotonic() > deadline:
                raise GuardRefused(
                    f"rank {rank} could not link to rank {right} at {address[0]}:{address[1]}: "
                    f"{why or exc}"
                ) from None
            time.sleep(0.1)


def _claim(
    address: tuple[str, int], rank: int, right: int, index: int, secret: bytes
) -> socket.socket:
    conn = socket.create_connection(address, timeout=HANDSHAKE_S)
    try:
        greeting = recv_frame(conn)
        if not greeting.startswith(LINK_MAGIC) or len(greeting) != len(LINK_MAGIC) + NONCE_BYTES:
            raise GuardRefused(f"{address[0]}:{address[1]} is not a rank's ring port")
        theirs, ours = greeting[len(LINK_MAGIC) :], os.urandom(NONCE_BYTES)
        ids = (rank_bytes(rank), rank_bytes(right), rank_bytes(index))
        tag = mac(secret, b"link", theirs, ours, *ids)
        send_frame(conn, rank_bytes(rank) + rank_bytes(index) + ours + tag)
        if not hmac.compare_digest(recv_frame(conn), mac(secret, b"linked", ours, theirs, *ids)):
            raise GuardRefused(f"rank {right} did not prove the group's secret")
        conn.settimeout(None)
        return conn
    except BaseException:
        conn.close()
        raise


class _Acceptor:
    """Accepts on one ring port until the left neighbour's link `index` is proved there."""

    def __init__(self, sock: socket.socket, index: int, rank: int, left: int, secret: bytes):
        self.sock, self.index, self.rank, self.left, self.secret = sock, index, rank, left, secret
        self.link: socket.socket | None = None
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._pending = threading.Semaphore(MAX_PENDING)
        self.dropped = 0
        threading.Thread(target=self._accept, name=f"ring-link-{index}", daemon=True).start()

    def wait(self, deadline: float, failed: Callable[[], str | None]) -> socket.socket:
        while not self._done.wait(0.1):
            why = failed()
            if why is not None or time.monotonic() > deadline:
                raise GuardRefused(
                    f"rank {self.left} did not link to rank {self.rank}: {why or 'timed out'}"
                )
        assert self.link is not None  # set before _done
        return self.link

    def _accept(self) -> None:
        while not self._done.is_set():
            try:
                conn, peer = self.sock.accept()
            except OSError:
                return  # closed: the links are made, or the group gave up
            if not self._pending.acquire(blocking=False):
                self._drop(conn, peer, "too many handshakes at once")
                continue
            threading.Thread(target=self._handshake, args=(conn, peer), daemon=True).start()

    def _drop(self, conn: socket.socket, peer: tuple, why: str) -> None:
        self.dropped += 1
        log.warning("ring port %d: dropped a connection from %s:%s: %s", self.index, *peer[:2], why)
        conn.close()

    def _handshake(self, conn: socket.socket, peer: tuple) -> None:
        try:
            conn.settimeout(HANDSHAKE_S)
            theirs = os.urandom(NONCE_BYTES)
            send_frame(conn, LINK_MAGIC + theirs)
            claim = recv_frame(conn)
            if len(claim) != _CLAIM:
                raise GuardRefused("it did not prove the group's secret")
            sender, index = int.from_bytes(claim[:4], "big"), int.from_bytes(claim[4:8], "big")
            ours, tag = claim[8 : 8 + NONCE_BYTES], claim[8 + NONCE_BYTES :]
            ids = (rank_bytes(sender), rank_bytes(self.rank), rank_bytes(index))
            if not hmac.compare_digest(tag, mac(self.secret, b"link", theirs, ours, *ids)):
                raise GuardRefused("it did not prove the group's secret")
            if (sender, index) != (self.left, self.index):
                raise GuardRefused(f"rank {sender}'s link {index} does not belong here")
            with self._lock:
                if self._done.is_set():
                    raise GuardRefused("this link is already made")
                send_frame(conn, mac(self.secret, b"linked", ours, theirs, *ids))
                conn.settimeout(None)
                self.link = conn
                self._done.set()
            log.info("ring port %d: rank %d linked from %s", self.index, sender, peer[0])
        except (OSError, ValueError, GuardRefused) as exc:
            self._drop(conn, peer, str(exc) or exc.__class__.__name__)
        finally:
            self._pending.release()
