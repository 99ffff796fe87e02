"""The sync and async clients share one core (client/core.py): the same socket checks and
endpoint (protocol.paths.endpoint_for, so a path the daemon could never bind is refused the same
way), the same handshake frame, the same reading of replies."""

from __future__ import annotations

import asyncio
import os
import socket
import tempfile
from pathlib import Path

import pytest

from moed.client import Client, DaemonRestarted, DaemonUnavailable, RequestFailed
from moed.client.async_client import AsyncClient
from moed.client.core import ClientCore, answer, read_frame
from moed.protocol import MessageType, decode, encode
from moed.protocol.paths import MAX_SOCKET_PATH


@pytest.fixture
def long_socket():
    """A real socket whose path is over the limit the daemon binds under (yet within sun_path)."""
    folder = Path(tempfile.mkdtemp(prefix="moedt-core-", dir="/tmp"))
    os.chmod(folder, 0o700)
    path = folder / ("s" * (MAX_SOCKET_PATH + 2 - len(str(folder)) - 1))
    assert len(str(path).encode()) > MAX_SOCKET_PATH
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(path))
    yield path
    listener.close()
    path.unlink()
    folder.rmdir()


def test_both_clients_refuse_a_path_no_daemon_binds(long_socket):
    with pytest.raises(DaemonUnavailable, match=f"over the {MAX_SOCKET_PATH}-byte limit"):
        Client(long_socket).connect()
    with pytest.raises(DaemonUnavailable, match=f"over the {MAX_SOCKET_PATH}-byte limit"):
        asyncio.run(AsyncClient(long_socket).connect())


def test_handshake_frames_and_replies(tmp_path):
    core = ClientCore(tmp_path / "s", timeout=1.0, heartbeat_s=0.5, dead_after_s=3.0, name="t")
    request_id, frame = core.hello()
    hello = decode(frame)
    assert hello["type"] == MessageType.HELLO.value and hello["client"] == "t"
    assert hello["id"] == request_id and core.next_id("gen") != request_id
    welcome = core.welcomed({"type": "welcome", "id": request_id, "boot_id": "b1"})
    assert core.welcome is welcome and core.boot_id == "b1"
    assert core.restart_of("b1") is None and core.restart_of(None) is None
    assert isinstance(core.restart_of("b2"), DaemonRestarted)
    cancel = decode(core.cancel_frame("gen-7"))
    assert cancel["type"] == MessageType.CANCEL.value and cancel["target"] == "gen-7"


def test_replies_read_and_mapped():
    assert read_frame(b"\xc1") is None  # not msgpack: skipped, the replies behind it still count
    assert read_frame(encode([1, 2])) is None  # no message
    assert read_frame(encode({"type": "pong", "id": 1})) == {"type": "pong", "id": 1}
    error = {"type": "error", "id": 1, "code": "bad_request", "message": "no", "retryable": False}
    with pytest.raises(RequestFailed, match="no"):
        answer(error)
