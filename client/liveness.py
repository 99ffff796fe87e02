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

import zmq


def dealer_socket(heartbeat_s: float, dead_after_s: float) -> zmq.Socket:
    """A DEALER socket whose connection is watched by ZMTP heartbeats."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RECONNECT_IVL, 50)
    sock.setsockopt(zmq.HEARTBEAT_IVL, max(1, round(heartbeat_s * 1000)))
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, max(1, round(dead_after_s * 1000)))
    return sock


def connection_lost(socket_path: Path, pid: object, dead_after_s: float) -> str:
    """Why the connection closed, for the DaemonUnavailable message: the process is gone, or it
    is there and stopped answering the connection's heartbeats."""
    if isinstance(pid, int) and pid > 0 and _exists(pid):
        return (
            f"the daemon at {socket_path} stopped answering: its connection missed heartbeats "
            f"for {dead_after_s:g}s (process {pid} is frozen or the machine is overloaded)"
        )
    return f"the connection to the daemon at {socket_path} dropped (it exited or crashed)"


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process of that number: not our daemon
        return False
    return True
