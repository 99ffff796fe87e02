"""What the sync and the asyncio client share: where the daemon listens, the connection and its
handshake, request ids, frames out and in, and what a reply means (an `error` is RequestFailed, a
new boot_id DaemonRestarted, no answer DaemonUnavailable). The two differ only in how they wait
for the socket (client.py polls it, async_client.py reads it from a file-descriptor callback).
"""

from __future__ import annotations

import itertools
import os
import uuid
from pathlib import Path
from typing import Any

import zmq

from moed.protocol import MessageType, ProtocolError, decode, encode
from moed.protocol import messages as wire
from moed.protocol.paths import (
    UnsafeSocketPath,
    check_socket,
    control_token_path,
    default_socket_path,
    endpoint_for,
    nobody_listens,
)

from .errors import (
    DaemonNotRunning,
    DaemonRestarted,
    DaemonUnavailable,
    InsecureSocket,
    RequestFailed,
)
from .liveness import connection_lost, dealer_socket, process_gone


class ClientCore:
    """One client's view of one daemon: the connection's settings and the daemon it met."""

    default_name = "moed.client"  # the handshake's client name when none is given

    def __init__(
        self,
        socket_path: str | Path | None = None,
        *,
        timeout: float = 10.0,
        heartbeat_s: float = 0.5,
        dead_after_s: float = 3.0,
        name: str | None = None,
    ):
        self.socket_path = Path(socket_path) if socket_path else default_socket_path()
        self.timeout = timeout
        self.heartbeat_s = heartbeat_s
        self.dead_after_s = dead_after_s
        self.name = name or self.default_name
        self.welcome: dict[str, Any] | None = None
        self.boot_id: str | None = None
        self._ids = itertools.count(1)
        self._prefix = uuid.uuid4().hex[:8]
        self._init_connection_state()

    def _init_connection_state(self) -> None:
        """The subclass's own per-connection fields (sockets, inboxes), before any connect."""

    # ---- the connection ------------------------------------------------------------------------
    def open_socket(self) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes]]:
        """A DEALER connected to the daemon, and its disconnect monitor. Nothing is sent to a
        socket that is missing or that another user could own."""
        try:  # an unsafe folder is said first, socket or not: nothing may start there either
            if os.path.lexists(self.socket_path.parent):
                check_socket(self.socket_path)
            endpoint = endpoint_for(self.socket_path)
        except UnsafeSocketPath as exc:
            raise InsecureSocket(str(exc)) from None
        except ValueError as exc:  # a path no daemon can bind
            raise DaemonUnavailable(str(exc)) from None
        if not self.socket_path.exists():
            raise DaemonNotRunning(f"no daemon is running (no socket at {self.socket_path})")
        # A socket file left by a daemon that died: ZMQ would retry the connect silently until
        # the handshake's timeout; the kernel's refusal says it at once.
        if nobody_listens(self.socket_path):
            raise DaemonNotRunning(
                f"no daemon is running on {self.socket_path} (the socket is left from one "
                "that exited or was killed)"
            )
        sock = dealer_socket(self.heartbeat_s, self.dead_after_s)
        # The daemon's death drops the ipc connection at once, and a frozen daemon's connection
        # misses its heartbeats (client/liveness.py): watch for that, not for silence.
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sock.connect(endpoint)
        return sock, monitor

    def hello(self) -> tuple[Any, bytes]:
        """The handshake's id and frame."""
        request_id = self.next_id(MessageType.HELLO.value)
        return request_id, self.frame(MessageType.HELLO, request_id, client=self.name)

    def welcomed(self, reply: dict[str, Any]) -> dict[str, Any]:
        """Take the handshake's answer (an `error` raises RequestFailed)."""
        msg = answer(reply)
        self.welcome = msg
        self.boot_id = msg.get("boot_id")
        return msg

    # ---- frames ----------------------------------------------------------------------------------
    def next_id(self, kind: str) -> str:
        return f"{self._prefix}-{kind}-{next(self._ids)}"

    def frame(self, kind: MessageType, request_id: Any, **fields: Any) -> bytes:
        return encode(wire.request(kind, request_id, **fields))

    def cancel_frame(self, target: Any) -> bytes:
        """Stop the daemon generating for nobody (no reply awaited)."""
        return self.frame(MessageType.CANCEL, self.next_id("cancel"), target=target)

    def owner_token(self) -> str | None:
        """The control token the daemon keeps beside its socket, readable by its owner only;
        None for anyone else (the daemon then answers not_permitted)."""
        try:
            fd = os.open(control_token_path(self.socket_path), os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return None
        with os.fdopen(fd) as f:
            return f.read().strip()

    # ---- what a reply means ------------------------------------------------------------------
    def restart_of(self, boot_id: str | None) -> DaemonRestarted | None:
        """The restart a reply's boot_id reveals, if any."""
        if boot_id and self.boot_id and boot_id != self.boot_id:
            old = self.boot_id
            return DaemonRestarted(f"the daemon restarted (boot {old} → {boot_id})", old, boot_id)
        return None

    def no_answer(self) -> DaemonUnavailable:
        return DaemonUnavailable(
            f"no answer from the daemon at {self.socket_path} within {self.timeout:.1f}s"
        )

    def exiting(self, silent_s: float) -> bool:
        """The daemon closed the connection itself (sooner than missed heartbeats could) and its
        process is still there: it may be stopping, or killed and not yet a zombie."""
        pid = (self.welcome or {}).get("pid")
        return isinstance(pid, int) and silent_s < self.dead_after_s and not process_gone(pid)

    def lost(self, silent_s: float) -> DaemonUnavailable:
        """The connection closed `silent_s` after the daemon's last reply: the process is gone
        (DaemonNotRunning), stopping, or frozen past its heartbeats."""
        pid = (self.welcome or {}).get("pid")
        message = connection_lost(self.socket_path, pid, self.dead_after_s, silent_s)
        return DaemonNotRunning(message) if process_gone(pid) else DaemonUnavailable(message)


def read_frame(frame: bytes) -> dict[str, Any] | None:
    """A reply frame as a message; None for what is no message of ours (the replies behind it
    still get through)."""
    try:
        msg = decode(frame)
    except ProtocolError:
        return None
    return msg if isinstance(msg, dict) else None


def answer(msg: dict[str, Any]) -> dict[str, Any]:
    """A reply, or RequestFailed when it is an `error`."""
    if msg.get("type") == MessageType.ERROR.value:
        raise RequestFailed.from_message(msg)
    return msg
