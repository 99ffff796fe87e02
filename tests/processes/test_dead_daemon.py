"""A dead daemon is known at once (issue 37): after a SIGKILL its socket file stays, nobody
listens on it, and its process is a zombie until its parent reaps it (here: this test, which
does not, so `kill(pid, 0)` still succeeds on it). `moe status` says "not running" with the run
that died in words, `moe run` starts a new daemon without the handshake's 10 s wait, the
gateway's /health and every API say "no daemon" (503, how to start one), and a stream the
kill cut is reported as gone, not as frozen."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import threading
import time

import httpx
import psutil
import pytest
from click.testing import CliRunner

from moed.client import DaemonNotRunning, TokenEvent
from moed.client.async_client import AsyncClient
from moed.client.cli import main as moe_main
from moed.client.exit_codes import ExitCode
from tests.fixtures.daemon_harness import moe, moe_command, stop_process
from tests.fixtures.gateway_harness import start_gateway

pytestmark = pytest.mark.process

AT_ONCE_S = 1.0  # what "at once" means: the old wait was the handshake's 10 s timeout
MESSAGES = [{"role": "user", "content": "Hello!"}]


def _kill(daemon) -> int:
    """SIGKILL the daemon and leave it unreaped: a zombie, as the issue saw it."""
    pid = daemon.proc.pid
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    os.kill(pid, 0)  # still "there" to kill(pid, 0)
    return pid


def _timed(call):
    started = time.monotonic()
    result = call()
    return result, time.monotonic() - started


def test_after_a_sigkill_status_and_the_gateway_say_no_daemon_at_once(
    daemon_factory, tiny_model, tmp_path
):
    d = daemon_factory(tiny_model, "--resident")
    gateway = start_gateway(tmp_path / "g", d.socket)
    try:
        assert httpx.get(f"{gateway.url}/health").json()["status"] == "ready"
        pid = _kill(d)

        health, took = _timed(lambda: httpx.get(f"{gateway.url}/health", timeout=30))
        assert took < AT_ONCE_S, took
        assert health.status_code == 503 and health.json()["status"] == "no_daemon"
        assert "moe run" in health.json()["error"]  # how to start one
        for path, body in (
            ("/v1/chat/completions", {"model": "m", "messages": MESSAGES}),
            ("/v1/responses", {"model": "m", "input": "Hello!"}),
            ("/v1/messages", {"model": "m", "max_tokens": 4, "messages": MESSAGES}),
            ("/api/chat", {"model": "m", "messages": MESSAGES}),
            ("/v1/models", None),
        ):
            call = (
                (lambda p=path: httpx.get(f"{gateway.url}{p}", timeout=30))
                if body is None
                else (lambda p=path, b=body: httpx.post(f"{gateway.url}{p}", json=b, timeout=30))
            )
            answer, took = _timed(call)
            assert took < AT_ONCE_S, (path, took)
            assert answer.status_code == 503, (path, answer.text)
            assert "no daemon is running" in answer.text and "moe run" in answer.text, path

        # `moe status` itself (in this process: an interpreter's start is not its answer).
        args = ["--socket", str(d.socket), "--state-dir", str(d.state_dir), "status"]
        result, took = _timed(lambda: CliRunner().invoke(moe_main, args))
        assert took < AT_ONCE_S, took
        assert result.exit_code == ExitCode.DAEMON_UNAVAILABLE
        assert "not running" in result.stderr
        # The run that died, in words (its crash is recorded when the next daemon starts).
        assert f"pid {pid}" in result.stderr and "without a clean exit" in result.stderr
        assert "{" not in result.stderr  # no raw JSON dict
        as_json = moe(d.socket, "--state-dir", str(d.state_dir), "status", "--json")
        body = json.loads(as_json.stdout.splitlines()[-1])
        assert body["code"] == "not_running" and body["last_run"]["pid"] == pid
    finally:
        gateway.stop()


def test_after_a_sigkill_moe_run_starts_a_new_daemon_without_waiting(
    daemon_factory, tiny_model, tmp_path
):
    d = daemon_factory(tiny_model, "--resident")
    _kill(d)
    state = ["--state-dir", str(tmp_path / "state"), "--log-dir", str(tmp_path / "logs")]
    cmd = moe_command(d.socket, *state, "run", "--model", str(tiny_model), "--raw")
    started = time.monotonic()
    run = subprocess.Popen(
        [*cmd, "--max-tokens", "3", "def f"], stderr=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        first = run.stderr.readline().decode()
        took = time.monotonic() - started  # an interpreter's start and one refused connect
        assert "starting one" in first, first
        assert took < 5.0, took  # was 10 s of handshake timeout, then the start
        out, err = run.communicate(timeout=180)
        assert run.returncode == 0, err.decode()
        assert out.decode().strip()
    finally:
        stop_process(run)
        moe(d.socket, "stop")  # the daemon it started (the harness stops only the killed one)


def test_a_stream_cut_by_a_sigkill_is_reported_gone_not_frozen(daemon_factory, tiny_model):
    d = daemon_factory(tiny_model, "--resident")

    def kill_when_streaming(streaming: threading.Event) -> None:
        streaming.wait(60)
        _kill(d)

    streaming = threading.Event()
    killer = threading.Thread(target=kill_when_streaming, args=(streaming,))
    killer.start()
    try:
        with d.client() as c, pytest.raises(DaemonNotRunning, match="is gone") as gone:
            for event in c.generate("The quick brown fox", max_tokens=4000, raw=True):
                if isinstance(event, TokenEvent):
                    streaming.set()
        assert "frozen" not in str(gone.value)
    finally:
        streaming.set()
        killer.join()

    async def connect() -> None:  # the gateway's client: refused at once, the same error
        await AsyncClient(d.socket).connect()

    with pytest.raises(DaemonNotRunning, match="no daemon is running"):
        _, took = _timed(lambda: asyncio.run(connect()))


def test_status_right_after_stop_says_not_running(daemon_factory, tiny_model):
    d = daemon_factory(tiny_model, "--resident")
    stopped = moe(d.socket, "--state-dir", str(d.state_dir), "stop")
    assert stopped.returncode == 0 and "daemon stopped" in stopped.stderr, stopped.stderr
    assert d.proc.wait(10) == 0
    status = moe(d.socket, "--state-dir", str(d.state_dir), "status")
    assert status.returncode == ExitCode.DAEMON_UNAVAILABLE
    assert "not running" in status.stderr and "dropped" not in status.stderr
    assert "moe run" in status.stderr  # how to start one
    assert "last run" not in status.stderr  # a clean stop is no crash


def test_a_gateway_without_a_daemon_warns_and_says_no_daemon(tmp_path):
    folder = tmp_path / "sock"
    folder.mkdir(mode=0o700)
    gateway = start_gateway(tmp_path / "g", folder / "d.sock")
    try:
        health = httpx.get(f"{gateway.url}/health")
        assert health.status_code == 503 and health.json()["status"] == "no_daemon"
        assert "no daemon is running" in gateway.log() and "moe run" in gateway.log()
    finally:
        gateway.stop()
