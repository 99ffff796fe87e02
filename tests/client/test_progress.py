"""Progress where a user looks: a bar on a terminal (a real pty), nothing in a pipe, JSON events in
--json modes."""

from __future__ import annotations

import fcntl
import io
import json
import os
import pty
import select
import shutil
import struct
import subprocess
import sys
import termios
import time

import pytest

from moed.client import progress
from moed.client.progress import Progress, ProgressMode, StagedProgress, Unit
from tests.fixtures.hub_cli import REPO, moe


def run_in_pty(args: list[str], env: dict, timeout_s: float = 120) -> tuple[int, str]:
    """Run with stdout and stderr on a pseudo-terminal; (exit code, everything it drew)."""
    master, slave = pty.openpty()
    # A real terminal has a size (tqdm draws to its width): 24 rows, 100 columns.
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    proc = subprocess.Popen(
        args, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, env={**os.environ, **env}
    )
    os.close(slave)
    chunks, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 0.2)
        if ready:
            try:
                data = os.read(master, 65536)
            except OSError:  # the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        elif proc.poll() is not None:
            break
    os.close(master)
    return proc.wait(timeout=10), b"".join(chunks).decode(errors="replace")


@pytest.mark.process
def test_pull_draws_a_bar_on_a_terminal_and_nothing_in_a_pipe(hub, hf_env):
    code, drawn = run_in_pty([sys.executable, "-m", "moed.client.cli", "pull", REPO], hf_env)
    assert code == 0, drawn
    assert f"pull {REPO}" in drawn and "100%" in drawn and "\r" in drawn  # redrawn in place
    assert "verified" in drawn
    piped = moe("rm", REPO, env=hf_env)
    assert piped.returncode == 0
    piped = moe("pull", REPO, env=hf_env)
    assert piped.returncode == 0 and "verified" in piped.stdout
    assert "%" not in piped.stderr and "\r" not in piped.stderr  # no bar in a log file


def test_json_progress_events_are_throttled_monotonic_and_final():
    out = io.StringIO()
    bar = Progress("task", ProgressMode.JSON, total=1000, unit=Unit.BYTES, out=out)
    for done in range(0, 1001, 10):
        bar.update(done)
    bar.close()
    events = [json.loads(line) for line in out.getvalue().splitlines()]
    assert all(e["type"] == "progress" and e["task"] == "task" for e in events)
    assert events[0]["done"] == 0 and events[-1]["done"] == 1000 and events[-1]["final"]
    assert len(events) < 10, "throttled: a fast loop is not a flood of lines"
    assert [e["done"] for e in events] == sorted(e["done"] for e in events)


def test_off_mode_writes_nothing_and_stages_get_their_own_task():
    out = io.StringIO()
    bar = Progress("task", ProgressMode.OFF, total=10, out=out)
    bar.update(5)
    bar.close()
    assert out.getvalue() == ""
    out = io.StringIO()
    staged = StagedProgress("loading", ProgressMode.JSON, out=out)
    staged.update("reading the checkpoint", 0, 1, "steps")
    staged.update("loading weights", 500, 1000, "bytes")
    staged.update("loading weights", 1000, 1000, "bytes")
    staged.close()
    events = [json.loads(line) for line in out.getvalue().splitlines()]
    tasks = [e["task"] for e in events if e.get("final")]
    assert tasks == ["loading: reading the checkpoint", "loading: loading weights"]
    assert {e["unit"] for e in events if e["task"].endswith("weights")} == {"bytes"}


@pytest.mark.process
def test_moe_run_shows_the_load_of_the_daemon_it_starts(tiny_model, tmp_path):
    from tests.fixtures.daemon_harness import short_socket_path

    socket = short_socket_path()
    env = {"MOED_STATE_DIR": str(tmp_path / "state"), "MOED_LOG_DIR": str(tmp_path / "logs")}
    args = [sys.executable, "-m", "moed.client.cli", "--socket", str(socket), "run"]
    try:
        code, drawn = run_in_pty(
            [*args, "--model", str(tiny_model), "--raw", "--max-tokens", "2", "def f"], env
        )
        assert code == 0, drawn
        # Stages as the daemon's status reports them: a tiny model may load between two polls,
        # but the wait before it answers and its last stage always show.
        assert "starting one" in drawn and "starting daemon: waiting for the daemon" in drawn
        assert "starting daemon: ready" in drawn
        assert "%|" in drawn and "\r" in drawn
        assert "[moe] 2 tokens" in drawn
    finally:
        stop = [sys.executable, "-m", "moed.client.cli", "--socket", str(socket), "stop"]
        subprocess.run(stop, capture_output=True, timeout=60)
        deadline = time.monotonic() + 30
        while socket.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        shutil.rmtree(socket.parent, ignore_errors=True)


@pytest.mark.process
def test_moed_serve_in_a_terminal_draws_the_model_load(tiny_model, tmp_path):
    import signal
    import threading

    from moed.client.autostart import wait_until_ready
    from tests.fixtures.daemon_harness import short_socket_path

    socket = short_socket_path()
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    env = {**os.environ, "MOED_STATE_DIR": str(tmp_path / "s"), "MOED_LOG_DIR": str(tmp_path / "l")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "moed.daemon.cli", "--socket", str(socket), "serve", "--model",
         str(tiny_model), "--keep-alive", "-1"],
        stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, env=env,
    )  # fmt: skip
    os.close(slave)
    chunks: list[bytes] = []

    def drain() -> None:  # keep reading, or the daemon would block on a full terminal
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        wait_until_ready(socket, proc, 60, tmp_path / "l" / "daemon.log")
        time.sleep(0.3)  # the bar thread polls every 0.1 s
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        reader.join(timeout=5)
        os.close(master)
        shutil.rmtree(socket.parent, ignore_errors=True)
    drawn = b"".join(chunks).decode(errors="replace")
    assert "loading: ready" in drawn and "%|" in drawn, drawn[-2000:]


def test_json_progress_that_does_not_move_is_one_line(monkeypatch):
    """A daemon that takes seconds to answer: each poll redraws the same wait, one line only."""
    monkeypatch.setattr(progress, "JSON_EVERY_S", 0.0)
    out = io.StringIO()
    staged = StagedProgress("starting daemon", ProgressMode.JSON, out=out)
    for _ in range(10):
        staged.update("waiting for the daemon", 0, None, "steps")
    staged.update("loading weights", 500, 1000, "bytes")
    staged.update("loading weights", 1000, 1000, "bytes")
    staged.close()
    tasks = [json.loads(line)["task"] for line in out.getvalue().splitlines()]
    waiting = [t for t in tasks if t.endswith("waiting for the daemon")]
    assert len(waiting) == 2  # the first and its final line
    assert len([t for t in tasks if t.endswith("weights")]) == 4  # 0, 500, 1000, final
