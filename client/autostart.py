"""Start a background daemon for `moe run` when none answers, and wait until it says hello."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from .client import Client
from .errors import DaemonUnavailable


def log_path_for(socket_path: Path) -> Path:
    return socket_path.parent / "moed-autostart.log"


def start_daemon(socket_path: Path, model: str | None = None, extra_args: tuple[str, ...] = ()) -> subprocess.Popen:
    socket_path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    cmd = [sys.executable, "-m", "moed.daemon.cli", "serve", "--socket", str(socket_path), *extra_args]
    if model:
        cmd += ["--model", model]
    log = open(log_path_for(socket_path), "ab")
    # A new session: the daemon outlives this shell and ignores its Ctrl-C.
    return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True, env=os.environ.copy())


def wait_until_ready(socket_path: Path, proc: subprocess.Popen, timeout_s: float) -> dict:
    """Poll until the daemon answers and its model is loaded."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log_path_for(socket_path).read_text(errors="replace")[-2000:]
            raise DaemonUnavailable(f"the daemon exited with code {proc.returncode} while starting:\n{tail}")
        try:
            with Client(socket_path, timeout=1.0) as client:
                status = client.status()
            if status.get("state") == "ready":
                return status
            if status.get("state") == "failed":
                raise DaemonUnavailable(f"the daemon could not load its model: {status.get('error')}")
        except DaemonUnavailable as exc:
            if "could not load" in str(exc):
                raise
        time.sleep(0.2)
    raise DaemonUnavailable(f"the daemon did not become ready within {timeout_s:.0f}s (log: {log_path_for(socket_path)})")
