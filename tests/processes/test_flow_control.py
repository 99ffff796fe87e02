"""Bounded everything: a client that does not read loses its streams (typed `slow_consumer`), not
the daemon's memory; other clients keep streaming; one connection cannot hold every pending slot;
the metrics endpoint caps and times out its connections."""

from __future__ import annotations

import socket
import subprocess
import threading
import time
import urllib.request

import msgpack
import pytest
import zmq

from moed.client import TokenEvent

SEND_HWM = 16
PER_CLIENT = 2
# A reading client's generations stay under the send limit in all (tokens, telemetry, done): on a
# loaded machine its reader may not run while a resident tiny model sends 20 tokens in 30 ms (CI).
READER_TOKENS = 8


BOUNDS = {"MOED_CLIENT_SEND_HWM": str(SEND_HWM), "MOED_MAX_PENDING_PER_CLIENT": str(PER_CLIENT)}


@pytest.fixture
def bounded_daemon(daemon_factory, tiny_model):
    return daemon_factory(tiny_model, "--resident", env=BOUNDS)


@pytest.fixture
def slow_bounded_daemon(daemon_factory, tiny_model):
    """As `bounded_daemon`, each engine step 100 ms longer: a stream needs over a second to
    fill its send limit, so a test that has not read yet is no slow consumer while it sends."""
    env = {**BOUNDS, "MOED_DEBUG_FAULTS": "step_delay_ms=100"}
    return daemon_factory(tiny_model, "--resident", env=env)


def _raw(d, rcvhwm: int = 1000) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, rcvhwm)
    sock.setsockopt(zmq.RCVBUF, 4096)
    sock.connect(f"ipc://{d.socket}")
    return sock


def _gen(request_id, **fields) -> bytes:
    body = {"v": 1, "type": "generate", "id": request_id, "raw": True, "prompt": "hello"}
    return msgpack.packb({**body, **fields})


@pytest.mark.process
def test_a_client_that_does_not_read_loses_its_streams_not_the_daemons_memory(bounded_daemon):
    d = bounded_daemon
    with d.client() as c:  # warm up first: the comparison is about the flood, not the first run
        list(c.generate("hi", max_tokens=READER_TOKENS, raw=True))
        rss_before = c.status()["rss_bytes"]
    slow = _raw(d, rcvhwm=1)
    slow.send(_gen("g", max_tokens=3000, telemetry_every=1))
    ping = msgpack.packb({"v": 1, "type": "ping", "id": "p"})
    flood = 100_000
    for _ in range(flood):
        slow.send(ping)
    # Another client streams normally meanwhile.
    with d.client() as c:
        stream = c.generate("hi", max_tokens=READER_TOKENS, raw=True)
        got = [e for e in stream if isinstance(e, TokenEvent)]
        assert got
        status = c.status()
    reply_bytes = flood * len(
        msgpack.packb(
            {
                "v": 1,
                "type": "result",
                "id": "p",
                "pong": True,
                "boot_id": "x" * 32,
                "pid": 1,
                "time": 1.0,
            }
        )
    )
    growth = status["rss_bytes"] - rss_before
    print(
        f"\nflooded {flood} pings ({reply_bytes / 1e6:.1f} MB of replies); rss grew "
        f"{growth / 1e6:.1f} MB"
    )
    assert growth < reply_bytes / 2
    # When it reads again, its stream's end is there: a typed, retryable slow_consumer.
    deadline = time.monotonic() + 30
    ended = None
    while ended is None and time.monotonic() < deadline:
        if slow.poll(1000):
            msg = msgpack.unpackb(slow.recv())
            if msg.get("id") == "g" and msg["type"] in ("done", "error"):
                ended = msg
    slow.close()
    assert ended is not None and ended["type"] == "error", ended
    assert ended["code"] == "slow_consumer" and ended["retryable"] is True
    with d.client() as c:
        assert c.status()["pending_requests"] == 0


@pytest.mark.process
def test_one_connection_cannot_hold_every_pending_slot(slow_bounded_daemon):
    # On the plain daemon the first stream could fill its send limit (and end as a slow
    # consumer, freeing its slot) before the third frame arrived, on a loaded machine.
    d = slow_bounded_daemon
    greedy = _raw(d)
    for i in range(PER_CLIENT + 1):
        greedy.send(_gen(f"g{i}", max_tokens=2000))
    refused = None
    deadline = time.monotonic() + 30
    while refused is None and time.monotonic() < deadline and greedy.poll(5000):
        msg = msgpack.unpackb(greedy.recv())
        if msg["type"] == "error":
            refused = msg
    assert refused is not None and refused["id"] == f"g{PER_CLIENT}", refused
    assert refused["code"] == "overloaded" and "per client" in refused["message"]
    with d.client() as c:  # another client is still admitted
        assert any(isinstance(e, TokenEvent) for e in c.generate("hi", max_tokens=3, raw=True))
    greedy.close()


@pytest.mark.process
def test_owner_token_stops_the_daemon(bounded_daemon):
    with bounded_daemon.client() as c:
        assert c.shutdown("test")["accepted"] is True
    assert bounded_daemon.proc.wait(30) == 0


@pytest.mark.process
def test_metrics_port_over_range_is_a_config_error(tmp_path, tiny_model):
    from tests.fixtures.daemon_harness import serve_command

    sock_dir = tmp_path / "s"
    out = subprocess.run(
        serve_command(tiny_model, sock_dir / "d.sock", tmp_path, "--metrics-port", "70000"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "metrics_port" in out.stderr and "70000" in out.stderr and "65535" in out.stderr
    assert not (sock_dir / "d.sock").exists()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.process
def test_metrics_endpoint_serves_the_daemon(daemon_factory, tiny_model):
    port = _free_port()
    daemon_factory(tiny_model, "--resident", "--metrics-port", str(port))
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    assert b"moed_" in body


def test_metrics_server_caps_and_times_out_connections():
    from moed.daemon.telemetry.http import start_metrics_server

    cap, timeout_s = 4, 0.3
    server = start_metrics_server(
        0, lambda: "moed_up 1\n", max_connections=cap, timeout_s=timeout_s
    )
    port = server.server_address[1]
    try:
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(cap * 5)]
        for s in idle:
            s.settimeout(timeout_s * 20)
        closed_at = []
        t0 = time.monotonic()

        def wait_closed(s):
            try:
                s.recv(1)
            except OSError:
                pass
            closed_at.append(time.monotonic() - t0)

        threads = [threading.Thread(target=wait_closed, args=(s,)) for s in idle]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        # Every idle connection was closed by the server: those over the cap at once, the others
        # after the timeout; none is held forever.
        assert len(closed_at) == len(idle) and max(closed_at) < timeout_s * 10
        assert server.refused > 0  # over the cap: closed at accept, not queued
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
        assert body == b"moed_up 1\n"
        for s in idle:
            s.close()
    finally:
        server.shutdown()
        server.server_close()
