"""mx.distributed's ring, formed over links moed proved (ring_links.py) instead of ports anyone
could reach first.

MLX's ring init listens, accepts and connects by itself, on the addresses of MLX_HOSTFILE, and
cannot be handed sockets. So each rank points its own hostfile at stand-ins on loopback that a
small child process serves: MLX's left addresses are free ports the child connects to as soon
as MLX listens there, and its right addresses are listeners the child accepts on (it accepts
everyone, so no stranger can fill their backlog). MLX's init then never waits on another host
and never meets another rank, and a stranger who connects to a stand-in first costs nothing:
right after init the sockets MLX holds (found by their addresses among this process's file
descriptors) are replaced, with dup2, by the proved links, so MLX sends and receives on those
from its first collective on. (Init keeps the GIL, so the stand-ins' other end cannot be a
thread of this process.)

Relied on in MLX (mlx/distributed/ring/ring.cpp, unchanged from 0.32.1 to 0.32.4): init makes
one socket per hostfile address (accept on its own, connect to its right neighbour's), sends
nothing during init, and afterwards uses each by its file descriptor from worker threads that
touch it only for a collective's send or receive, on a non-blocking descriptor. Checked by the
pipeline tests: a change there fails the group's start or its tokens.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx

from moed.daemon.distributed.ring_links import RingLinks

LOOPBACK = "127.0.0.1"
HELD_MAX = 1024  # connections the child keeps open on its listeners (MLX's come first)

# The stand-ins' other end: connects to each of MLX's left addresses once it listens there (MLX
# listens on them one after another) and accepts on the right ones, holding what it gets until
# the parent closes its stdin (by then MLX holds the proved links instead).
STAND_INS = f"""
import select, socket, sys, time
HELD_MAX = {HELD_MAX}
lefts = [a for a in sys.argv[1].split(",") if a]
rights = [socket.socket(fileno=int(fd)) for fd in sys.argv[2].split(",") if fd]
for listener in rights:
    listener.setblocking(False)
held = []
while True:
    ready = select.select([sys.stdin, *rights], [], [], 0.001)[0]
    if sys.stdin in ready:
        break
    for listener in rights:
        if listener in ready:
            try:
                conn = listener.accept()[0]
            except OSError:
                continue
            if len(held) < HELD_MAX:
                held.append(conn)
            else:
                conn.close()
    for address in list(lefts):  # each, every round: a stranger may have taken one first
        host, port = address.rsplit(":", 1)
        try:
            held.append(socket.create_connection((host, int(port)), timeout=1))
            lefts.remove(address)
        except OSError:
            pass
"""


def init_ring(links: RingLinks, rank: int, size: int, folder: str | Path) -> Any:
    """mx.distributed.init(backend="ring") for this rank, over `links`; returns the group."""
    lefts = [_free_port() for _ in links.left]  # where MLX will listen
    catchers = [socket.create_server((LOOPBACK, 0)) for _ in links.right]
    rights = [s.getsockname() for s in catchers]
    nodes = [[_name(a) for a in lefts]] * size
    nodes[(rank + 1) % size] = [_name(a) for a in rights]
    hostfile = _write_hostfile(nodes, Path(folder))
    os.environ["MLX_HOSTFILE"] = hostfile
    fds = [s.fileno() for s in catchers]
    stand_ins = subprocess.Popen(
        [
            sys.executable,
            "-S",
            "-c",
            STAND_INS,
            ",".join(_name(a) for a in lefts),
            ",".join(str(fd) for fd in fds),
        ],
        stdin=subprocess.PIPE,
        pass_fds=fds,
    )
    try:
        group = mx.distributed.init(backend="ring", strict=True)
        _hand_over(links, lefts, rights)
    finally:
        assert stand_ins.stdin is not None  # stdin=PIPE
        stand_ins.stdin.close()
        stand_ins.wait()
        os.unlink(hostfile)
        for sock in catchers:
            sock.close()
    return group


def _free_port() -> tuple[str, int]:
    """A free loopback port for one of MLX's listeners (unseen until MLX listens there)."""
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()


def _name(address: tuple[str, int]) -> str:
    return f"{address[0]}:{address[1]}"


def _write_hostfile(nodes: list[list[str]], folder: Path) -> str:
    path = folder / f"ring-stand-ins-{os.getpid()}.json"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(nodes, f)
    return str(path)


def _hand_over(links: RingLinks, lefts: list[tuple], rights: list[tuple]) -> None:
    """Put each proved link where MLX holds its stand-in: left i is the descriptor connected at
    MLX's left address i (whoever connected), right i the one connected to catcher i."""
    found_left: dict[int, int] = {}
    found_right: dict[int, int] = {}
    for fd, local, peer in _own_sockets():
        if peer is None:
            continue
        if local in lefts:
            found_left.setdefault(lefts.index(local), fd)
        elif peer in rights:
            found_right.setdefault(rights.index(peer), fd)
    if len(found_left) != len(lefts) or len(found_right) != len(rights):
        raise RuntimeError(
            f"the ring's sockets were not where MLX's init leaves them ({len(found_left)} of "
            f"{len(lefts)} left, {len(found_right)} of {len(rights)} right): MLX changed"
        )
    for links_of, found in ((links.left, found_left), (links.right, found_right)):
        for index, link in enumerate(links_of):
            link.setblocking(False)  # as MLX made its own: one thread sends and receives
            link.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            os.dup2(link.fileno(), found[index], inheritable=False)
            link.close()  # MLX's descriptor holds the link now


def _own_sockets() -> list[tuple[int, tuple, tuple | None]]:
    """(descriptor, local address, peer address or None) of this process's TCP sockets."""
    folder = "/proc/self/fd" if os.path.isdir("/proc/self/fd") else "/dev/fd"
    out = []
    for name in os.listdir(folder):
        fd = int(name)
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        with sock:
            if sock.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            try:
                local = sock.getsockname()
            except OSError:
                continue
            try:
                peer = sock.getpeername()
            except OSError:
                peer = None
        out.append((fd, local, peer))
    return out
