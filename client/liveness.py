"""Liveness by the connection, not by silence: a daemon reading a long prompt on a loaded machine
may not answer a ping for many seconds, yet it is alive.

Each client socket sends ZMTP heartbeats (PING commands of the connection itself, answered by
libzmq's I/O thread inside the daemon's process whatever its Python threads are doing). A frozen
process (SIGSTOP, a machine swapping itself to death) misses them: after `dead_after_s` libzmq
closes the connection and the client's disconnect monitor fires, as it does at once when the
process exits. Silence alone never fails a request.
"""

from __future__ import annotations

import os
from pathlib import Path

import psutil
import zmq

# A killed process's connections close a moment before it is a zombie (its files go first, in
# the kernel's exit): a connection the daemon closed is judged again until this long after.
EXIT_GRACE_S = 0.3


def dealer_socket(heartbeat_s: float, dead_after_s: float) -> zmq.Socket[bytes]:
    """A DEALER socket whose connection is watched by ZMTP heartbeats."""
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RECONNECT_IVL, 50)
    sock.setsockopt(zmq.HEARTBEAT_IVL, max(1, round(heartbeat_s * 1000)))
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, max(1, round(dead_after_s * 1000)))
    return sock


def connection_lost(socket_path: Path, pid: object, dead_after_s: float, silent_s: float) -> str:
    """Why the connection closed, for the DaemonUnavailable message: the process is gone; or it
    closed the connection itself (it is stopping: the heartbeats cannot have missed sooner than
    `dead_after_s` after the last reply, `silent_s` ago); or it stopped answering them."""
    if not isinstance(pid, int):  # before the welcome: no process to ask about
        return f"the connection to the daemon at {socket_path} dropped before its handshake"
    if process_gone(pid):
        return f"the daemon at {socket_path} is gone (process {pid} exited or was killed)"
    if silent_s < dead_after_s:
        return f"the daemon at {socket_path} closed the connection (process {pid} is stopping)"
    return (
        f"the daemon at {socket_path} stopped answering: its connection missed heartbeats "
        f"for {dead_after_s:g}s (process {pid} is frozen or the machine is overloaded)"
    )


def process_gone(pid: object) -> bool:
    """Whether the daemon's process has ended: no such process, another user's process of that
    number, or a zombie (exited, not yet reaped: `kill(pid, 0)` still succeeds on one, so its
    state is read, /proc/<pid>/stat on Linux and the kernel's process table on macOS)."""
    if not isinstance(pid, int) or pid <= 0:
        return False  # unknown: nothing says it is gone
    try:
        process = psutil.Process(pid)
        return process.status() == psutil.STATUS_ZOMBIE or process.uids().real != os.getuid()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return True
