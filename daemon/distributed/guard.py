"""moed's guard in front of mx.distributed's ring: only ranks that know the group's secret learn
where the ring listens.

The ring backend accepts the first TCP connection on each of its ports and cannot tell a rank
from anyone else (mlx/distributed/ring/ring.cpp: bind, listen, accept once), so a stray
connection there used to take a rank's place and fail the group. Now the published port
(`pipeline_port`, on rank 0's hostfile address) is this guard: rank 0 hands each follower a
random secret out of band (its stdin pipe, locally and through ssh), each follower proves it
(HMAC over fresh nonces, both ways) and says where its ring ports listen (moed's own listeners,
on the addresses the hostfile names: ring_links.py), and only then does rank 0 send every
authenticated rank the ring's addresses. A connection that does not prove the secret within a
few seconds is dropped and logged; the group is not touched.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable

from moed.daemon.distributed.hostfile import RankHost

log = logging.getLogger("moed.distributed")

MAGIC = b"moed-guard-1"
NONCE_BYTES = 32
SECRET_BYTES = 32
HANDSHAKE_S = 5.0  # a peer that has not proved the secret by then is dropped
MAX_FRAME = 64 * 1024
MAX_PENDING = 64  # handshakes at once; more connections are closed at once


class GuardRefused(Exception):
    """The other side did not prove the group's secret, or spoke something else."""


def new_secret() -> bytes:
    return os.urandom(SECRET_BYTES)


def mac(secret: bytes, label: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 under the group's secret of a label and length-prefixed parts."""
    h = hmac.new(secret, label, hashlib.sha256)
    for part in parts:
        h.update(len(part).to_bytes(4, "big") + part)
    return h.digest()


def send_frame(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(len(payload).to_bytes(4, "big") + payload)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise GuardRefused("the connection closed")
        out += chunk
    return bytes(out)


def recv_frame(sock: socket.socket) -> bytes:
    n = int.from_bytes(recv_exact(sock, 4), "big")
    if n > MAX_FRAME:
        raise GuardRefused(f"a {n}-byte frame")
    return recv_exact(sock, n)


def rank_bytes(rank: int) -> bytes:
    return rank.to_bytes(4, "big")


class Rendezvous:
    """Rank 0's side: listens on the guard address until every follower has proved the secret."""

    def __init__(
        self,
        hosts: tuple[RankHost, ...],
        address: tuple[str, int],
        secret: bytes,
        ring0: list[str],
    ):
        self.hosts = hosts
        self.secret = secret
        self.listener = socket.create_server(address)
        self.ring: dict[int, list[str]] = {0: ring0}  # rank 0's ring ports, already listening
        self.dropped = 0
        self._peers: dict[int, tuple[socket.socket, bytes]] = {}
        self._lock = threading.Lock()
        self._pending = threading.Semaphore(MAX_PENDING)
        self._done = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="pipeline-guard", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, peer = self.listener.accept()
            except OSError:
                return
            if not self._pending.acquire(blocking=False):
                self._drop(conn, peer, "too many handshakes at once")
                continue
            threading.Thread(target=self._handshake, args=(conn, peer), daemon=True).start()

    def _drop(self, conn: socket.socket, peer, why: str) -> None:
        self.dropped += 1
        log.warning("pipeline guard: dropped a connection from %s:%s: %s", *peer[:2], why)
        conn.close()

    def _handshake(self, conn: socket.socket, peer) -> None:
        try:
            conn.settimeout(HANDSHAKE_S)
            nonce0 = os.urandom(NONCE_BYTES)
            send_frame(conn, MAGIC + nonce0)
            reply = recv_frame(conn)
            if len(reply) < 68:
                raise GuardRefused("it did not prove the group's secret")
            rank = int.from_bytes(reply[:4], "big")
            nonce1, tag, body = reply[4:36], reply[36:68], reply[68:]
            expect = mac(self.secret, b"rank", nonce0, nonce1, rank_bytes(rank), body)
            if not hmac.compare_digest(tag, expect):
                raise GuardRefused("it did not prove the group's secret")
            if not 1 <= rank < len(self.hosts):
                raise GuardRefused(f"rank {rank} is not in a group of {len(self.hosts)}")
            ring = self._check_ring(rank, body)
            send_frame(conn, mac(self.secret, b"leader", nonce1, nonce0, rank_bytes(rank)))
            with self._lock:
                if rank in self._peers or self._closed:
                    raise GuardRefused(f"rank {rank} has already joined")
                self._peers[rank] = (conn, nonce1)
                self.ring[rank] = ring
                complete = len(self._peers) == len(self.hosts) - 1
            log.info("pipeline guard: rank %d joined from %s", rank, peer[0])
            if complete:
                self._hand_out()
        except (OSError, ValueError, GuardRefused) as exc:
            self._drop(conn, peer, str(exc) or exc.__class__.__name__)
        finally:
            self._pending.release()

    def _check_ring(self, rank: int, body: bytes) -> list[str]:
        ring = json.loads(body)
        if not isinstance(ring, list) or not all(isinstance(a, str) for a in ring):
            raise GuardRefused(f"rank {rank} sent no list of ring addresses")
        if [a.rsplit(":", 1)[0] for a in ring] != list(self.hosts[rank].ips):
            raise GuardRefused(f"rank {rank} named ring addresses other than its hostfile's")
        return ring

    def _hand_out(self) -> None:
        # The published port stops listening before anyone learns the group formed: `wait()`
        # returning (and a follower holding the ring) means nothing answers there any more.
        self.close()
        body = json.dumps([self.ring[r] for r in range(len(self.hosts))]).encode()
        for conn, nonce1 in self._peers.values():
            send_frame(conn, mac(self.secret, b"ring", nonce1, body) + body)
            conn.close()
        self._done.set()

    def wait(self, failed: Callable[[], str | None]) -> list[list[str]]:
        """Every rank's ring addresses, once all have joined; `failed()` says why to give up."""
        while not self._done.wait(0.1):
            if (why := failed()) is not None:
                raise GuardRefused(f"the group did not form: {why}")
        return [self.ring[r] for r in range(len(self.hosts))]

    def close(self) -> None:
        self._closed = True
        try:  # shutdown first: a plain close leaves the accept thread's call listening
            self.listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.listener.close()


def join(
    address: tuple[str, int], rank: int, ring: list[str], secret: bytes, connect_s: float = 60.0
) -> list[list[str]]:
    """A follower's side: prove the secret to rank 0, say where this rank's ring ports listen
    (`ring`), and learn every rank's."""
    deadline = time.monotonic() + connect_s
    while True:
        try:
            conn = socket.create_connection(address, timeout=HANDSHAKE_S)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    with conn:
        greeting = recv_frame(conn)
        if not greeting.startswith(MAGIC) or len(greeting) != len(MAGIC) + NONCE_BYTES:
            raise GuardRefused(f"{address[0]}:{address[1]} is not rank 0's guard")
        nonce0, nonce1 = greeting[len(MAGIC) :], os.urandom(NONCE_BYTES)
        body = json.dumps(ring).encode()
        tag = mac(secret, b"rank", nonce0, nonce1, rank_bytes(rank), body)
        send_frame(conn, rank_bytes(rank) + nonce1 + tag + body)
        proof = recv_frame(conn)
        if not hmac.compare_digest(proof, mac(secret, b"leader", nonce1, nonce0, rank_bytes(rank))):
            raise GuardRefused("rank 0 did not prove the group's secret")
        conn.settimeout(None)  # the other ranks may still be starting: rank 0 closes when it fails
        answer = recv_frame(conn)
    tag, body = answer[:32], answer[32:]
    if not hmac.compare_digest(tag, mac(secret, b"ring", nonce1, body)):
        raise GuardRefused("the ring's addresses did not come from rank 0")
    return json.loads(body)


def write_ring_hostfile(ring: list[list[str]], folder) -> str:
    """MLX_HOSTFILE for mx.distributed's ring backend, readable by this user only."""
    fd = os.open(
        os.path.join(folder, "ring-hostfile.json"),
        os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW,
        0o600,
    )
    with os.fdopen(fd, "w") as f:
        json.dump(ring, f)
    return os.path.join(folder, "ring-hostfile.json")
