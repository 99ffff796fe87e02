"""The protocol contract of PROTOCOL.md, point by point, against a real daemon over raw sockets:
cancel ordering, capped max_tokens with a notice, max_tokens counting resumed tokens, defaults,
model names, client disconnects, a client-side daemon_unavailable, a failed handshake that closes
its sockets."""

from __future__ import annotations

import os
import shutil
import signal
import socket as pysocket
import time

import msgpack
import pytest
import zmq

from moed.client import Client, DaemonUnavailable, RequestFailed, TokenEvent
from moed.protocol import ErrorCode
from tests.fixtures.daemon_harness import short_socket_path, start_daemon

LIMIT = 40  # the daemon's max_tokens_limit in this module


@pytest.fixture(scope="module")
def d(tmp_path_factory, tiny_model):
    """One daemon for the module (each test leaves it idle): its start is most of a test's time."""
    daemon = start_daemon(
        tmp_path_factory.mktemp("contract"),
        tiny_model,
        "--resident",
        env={"MOED_MAX_TOKENS_LIMIT": str(LIMIT)},
    )
    yield daemon
    daemon.stop()


def _connect(daemon) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"ipc://{daemon.socket}")
    return sock


@pytest.fixture
def raw(d):
    sock = _connect(d)
    yield sock
    sock.close()


def _send(sock, **msg) -> None:
    sock.send(msgpack.packb({"v": 1, **msg}))


def _until_terminal(sock, request_id) -> list[dict]:
    out = []
    while sock.poll(15_000):
        msg = msgpack.unpackb(sock.recv())
        out.append(msg)
        if msg.get("id") == request_id and msg["type"] in ("done", "error"):
            return out
    raise AssertionError(f"no terminal for {request_id}: {out[-3:]}")


@pytest.mark.process
def test_cancel_result_comes_before_done_and_no_token_after_it(daemon):
    raw = _connect(daemon)  # no max_tokens limit: the stream is still running at the cancel
    _send(raw, type="generate", id="g", prompt="hello", raw=True, max_tokens=4000)
    seen = 0
    while seen < 3:
        assert raw.poll(15_000)
        seen += msgpack.unpackb(raw.recv())["type"] == "token"
    _send(raw, type="cancel", id="c", target="g")
    rest = _until_terminal(raw, "g")
    kinds = [(m["id"], m["type"]) for m in rest]
    result_at = kinds.index(("c", "result"))
    result = rest[result_at]
    assert result["cancelled"] is True
    after = rest[result_at + 1 :]
    assert all(m["type"] != "token" for m in after), kinds
    done = rest[-1]
    assert done["type"] == "done" and done["finish_reason"] == "cancelled"
    tokens = seen + sum(m["type"] == "token" and m["id"] == "g" for m in rest[:result_at])
    assert result["tokens_sent"] == tokens == done["usage"]["completion_tokens"]
    # A cancel of a stream that already ended: cancelled false, nothing else follows.
    _send(raw, type="cancel", id="c2", target="g")
    assert _until_terminal_result(raw, "c2")["cancelled"] is False
    raw.close()


def _until_terminal_result(sock, request_id) -> dict:
    while sock.poll(10_000):
        msg = msgpack.unpackb(sock.recv())
        if msg.get("id") == request_id:
            return msg
    raise AssertionError("no result")


@pytest.mark.process
def test_over_limit_max_tokens_is_capped_with_a_notice(raw):
    _send(raw, type="generate", id="big", prompt_ids=[5, 6, 7], max_tokens=LIMIT * 10)
    done = _until_terminal(raw, "big")[-1]
    assert done["type"] == "done" and done["usage"]["completion_tokens"] <= LIMIT
    assert "capped" in done["notice"] and str(LIMIT * 10) in done["notice"]


@pytest.mark.process
def test_max_tokens_counts_resumed_tokens(d):
    n, k = 12, 5
    with d.client() as c:
        first = [e for e in c.generate(prompt_ids=[5, 6, 7], max_tokens=n) if e]
        ids = [t for e in first if isinstance(e, TokenEvent) for t in e.ids]
        if first[-1].finish_reason != "length":
            pytest.skip("the tiny model stopped early on this prompt")
        events = list(c.generate(prompt_ids=[5, 6, 7], max_tokens=n, resume_ids=ids[:k]))
    tokens = [e for e in events if isinstance(e, TokenEvent) and e.ids]
    assert [e.index for e in tokens] == list(range(k, n))
    assert [t for e in tokens for t in e.ids] == ids[k:]
    assert events[-1].usage["completion_tokens"] == n - k


@pytest.mark.process
def test_defaults_are_announced_and_applied(d):
    with d.client() as c:
        limits = c.connect()["limits"]
        assert limits["max_tokens"] == LIMIT and limits["default_max_tokens"] >= 1
        every = limits["telemetry_every"]
        events = list(c.generate(prompt_ids=[5, 6, 7], max_tokens=min(LIMIT, 2 * every + 1)))
    done = events[-1]
    if done.finish_reason == "length":
        telemetry = [e for e in events if type(e).__name__ == "TelemetryEvent"]
        assert len(telemetry) == (2 * every + 1) // every


@pytest.mark.process
def test_model_names(d, tiny_model):
    with d.client() as c:
        for name in (tiny_model.name, str(tiny_model)):
            assert list(c.generate("hi", max_tokens=1, raw=True, model=name))[-1].finish_reason
        with pytest.raises(RequestFailed) as info:
            list(c.generate("hi", max_tokens=1, raw=True, model="someone-else/model"))
        assert info.value.code is ErrorCode.MODEL_NOT_FOUND


@pytest.mark.process
def test_client_disconnect_cancels_its_generation(d, raw):
    _send(raw, type="generate", id="gone", prompt="hello", raw=True, max_tokens=LIMIT)
    assert raw.poll(15_000) and msgpack.unpackb(raw.recv())["type"] == "token"
    raw.close()
    with d.client() as c:
        deadline = time.monotonic() + 15
        while c.status()["pending_requests"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert c.status()["pending_requests"] == 0


@pytest.mark.process
def test_a_dead_daemon_is_daemon_unavailable_on_the_client(daemon):
    with daemon.client() as c:
        events = c.generate("hello", max_tokens=4000, raw=True)
        next(e for e in events if isinstance(e, TokenEvent))
        daemon.proc.send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(DaemonUnavailable) as info:
            for _ in events:
                pass
    assert info.value.code is ErrorCode.DAEMON_UNAVAILABLE and info.value.retryable
    assert time.monotonic() - t0 < 10


def test_a_failed_handshake_leaves_no_socket_open():
    """A socket file nobody answers on (a daemon killed mid-start): every connect times out with
    DaemonUnavailable and closes its zmq sockets. They used to stay open, and a process that
    polls a starting daemon (moe run, the tests) ran out of the zmq context's 1023 sockets."""
    path = short_socket_path()
    path.parent.mkdir(mode=0o700)
    try:
        stale = pysocket.socket(pysocket.AF_UNIX)
        stale.bind(str(path))
        stale.close()  # the file stays; nothing listens behind it
        failed = []  # kept alive, so only close() can release their sockets
        zmq.Context.instance().socket(zmq.DEALER).close()  # the context's own files exist first
        before = len(os.listdir("/proc/self/fd"))
        for _ in range(10):
            client = Client(path, timeout=0.05)
            with pytest.raises(DaemonUnavailable):
                client.connect()
            failed.append(client)
        # zmq closes a socket's files on its reaper thread, a moment after close() returns.
        deadline = time.monotonic() + 5
        while len(os.listdir("/proc/self/fd")) - before >= 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(os.listdir("/proc/self/fd")) - before < 5
    finally:
        shutil.rmtree(path.parent, ignore_errors=True)
