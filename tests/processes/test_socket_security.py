"""The socket directory is the daemon user's own, mode 0700, not a symlink: anything else is refused
by the daemon (exit 2, one line, nothing chmodded) and by the client (nothing sent). Side files are
opened without following symlinks."""

from __future__ import annotations

import asyncio
import os
import shutil
import stat
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from moed.client import Client, InsecureSocket
from moed.client.async_client import AsyncClient
from tests.fixtures.daemon_harness import serve_command

pytestmark = pytest.mark.process

# A fake daemon in the other user's directory: binds the socket and prints whatever arrives. (It
# runs as this user: the other one cannot read this venv, and the directory's owner is the point.)
LISTENER = """
import sys, zmq
sock = zmq.Context().socket(zmq.ROUTER)
sock.bind("ipc://" + sys.argv[1])
print("bound", flush=True)
if sock.poll(int(float(sys.argv[2]) * 1000)):
    print("RECEIVED", sock.recv_multipart(), flush=True)
"""


def _serve(model, socket: Path, tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        serve_command(model, socket, tmp_path / "state", "--resident", *extra),
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "MOED_LOG_DIR": str(tmp_path / "logs")},
    )


def _one_line_refusal(out: subprocess.CompletedProcess, *words: str) -> None:
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    lines = [line for line in out.stderr.splitlines() if "moed:" in line]
    assert len(lines) == 1 and all(w in lines[0] for w in words), out.stderr


def test_another_users_socket_dir_is_refused_by_daemon_and_client(other_user, tiny_model, tmp_path):
    sock_dir = Path(f"/tmp/moedt-evil-{uuid.uuid4().hex[:8]}")
    sock_dir.mkdir(mode=0o700)
    os.chown(sock_dir, other_user.pw_uid, other_user.pw_gid)  # as if that user pre-created it
    socket = sock_dir / "moed.sock"

    listener = None
    try:
        listener = subprocess.Popen(
            [sys.executable, "-c", LISTENER, str(socket), "3"],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert listener.stdout.readline().strip() == "bound"
        # The daemon refuses the directory and leaves it as it found it.
        out = _serve(tiny_model, socket, tmp_path)
        _one_line_refusal(out, str(sock_dir), f"uid {other_user.pw_uid}")
        st = os.lstat(sock_dir)
        assert st.st_uid == other_user.pw_uid and stat.S_IMODE(st.st_mode) == 0o700
        # The client refuses before sending a byte: the fake daemon hears nothing.
        with pytest.raises(InsecureSocket):
            Client(socket, timeout=1.0).connect()
        with pytest.raises(InsecureSocket):  # the gateway's client too
            asyncio.run(AsyncClient(socket, timeout=1.0).connect())
        cli = subprocess.run(
            [
                sys.executable,
                "-m",
                "moed.client.cli",
                "--socket",
                str(socket),
                "run",
                "--no-start",
                "secret prompt",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert cli.returncode != 0 and f"uid {other_user.pw_uid}" in cli.stderr, cli.stderr
        rest, _ = listener.communicate(timeout=10)
        assert "RECEIVED" not in rest, rest
    finally:
        if listener is not None:
            listener.kill()
            listener.wait()
        shutil.rmtree(sock_dir, ignore_errors=True)


def test_open_or_symlinked_dirs_are_refused_and_never_chmodded(tiny_model, tmp_path):
    loose = Path(f"/tmp/moedt-loose-{uuid.uuid4().hex[:8]}")
    loose.mkdir()
    os.chmod(loose, 0o755)
    link = Path(f"/tmp/moedt-link-{uuid.uuid4().hex[:8]}")
    real = Path(f"/tmp/moedt-real-{uuid.uuid4().hex[:8]}")
    real.mkdir(mode=0o700)
    link.symlink_to(real)
    try:
        out = _serve(tiny_model, loose / "d.sock", tmp_path)
        _one_line_refusal(out, "mode 0755", "0700")
        assert stat.S_IMODE(os.stat(loose).st_mode) == 0o755  # not chmodded
        out = _serve(tiny_model, link / "d.sock", tmp_path)
        _one_line_refusal(out, "symlink")
        # A socket straight in sticky /tmp: refused, and /tmp keeps its 1777.
        tmp_mode = stat.S_IMODE(os.stat("/tmp").st_mode)
        out = _serve(tiny_model, Path(f"/tmp/moedt-{uuid.uuid4().hex[:6]}.sock"), tmp_path)
        _one_line_refusal(out, "/tmp")
        assert stat.S_IMODE(os.stat("/tmp").st_mode) == tmp_mode
    finally:
        shutil.rmtree(loose, ignore_errors=True)
        link.unlink()
        shutil.rmtree(real, ignore_errors=True)


def test_moe_in_an_open_socket_dir_says_one_line_and_exits_2(tmp_path):
    """`moe run` (which would start a daemon there) and `moe status` refuse as `moed serve`
    does: one line, exit 2, no traceback, and nothing started or chmodded."""
    loose = Path(f"/tmp/moedt-loose-{uuid.uuid4().hex[:8]}")
    loose.mkdir()
    os.chmod(loose, 0o755)
    try:
        for args in (("run", "hello"), ("status",), ("stats",), ("stop",)):
            out = subprocess.run(
                [sys.executable, "-m", "moed.client.cli", "--socket", str(loose / "d.sock"), *args],
                capture_output=True,
                text=True,
                timeout=60,
                env={**os.environ, "MOED_STATE_DIR": str(tmp_path / "state")},
            )
            assert out.returncode == 2, (args, out.stderr)
            lines = out.stderr.strip().splitlines()
            assert len(lines) == 1 and "mode 0755" in lines[0] and "0700" in lines[0], out.stderr
            assert lines[0].startswith("moe: "), out.stderr
        assert list(loose.iterdir()) == [] and stat.S_IMODE(os.stat(loose).st_mode) == 0o755
    finally:
        shutil.rmtree(loose, ignore_errors=True)


def test_side_files_are_not_followed_through_symlinks(daemon_factory, tiny_model, tmp_path):
    """daemon.log and watchdog.jsonl planted as symlinks: the daemon and the watchdog keep working
    and never write through them."""
    victim = tmp_path / "victim.txt"
    victim.write_text("untouched\n")
    logs = tmp_path / "d0" / "logs"
    logs.mkdir(parents=True)
    (logs / "daemon.log").symlink_to(victim)
    d = daemon_factory(tiny_model, "--resident")
    with d.client() as c:
        assert c.status()["state"] == "ready"
    assert "cannot be opened" in d.log()
    state = d.state_dir
    state.mkdir(parents=True, exist_ok=True)
    (state / "watchdog.jsonl").symlink_to(victim)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "moed.daemon.cli",
            "watchdog",
            "--socket",
            str(d.socket),
            "--state-dir",
            str(state),
            "--once",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    time.sleep(0.1)
    assert victim.read_text() == "untouched\n"
