"""Start a background daemon for `moe run` when none answers, and wait until it says hello."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moed.protocol.paths import UnsafeSocketPath, ensure_private_dir

from .client import Client
from .errors import DaemonUnavailable, InsecureSocket


def log_path_for(socket_path: Path) -> Path:
    return socket_path.parent / "moed-autostart.log"


def start_daemon(
    socket_path: Path,
    model: str | None = None,
    extra_args: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    try:  # another user's directory is refused, never used
        ensure_private_dir(socket_path.parent)
    except UnsafeSocketPath as exc:
        raise InsecureSocket(str(exc)) from None
    cmd = [
        sys.executable,
        "-m",
        "moed.daemon.cli",
        "serve",
        "--socket",
        str(socket_path),
        *extra_args,
    ]
    if model:
        cmd += ["--model", model]
    log_fd = os.open(
        log_path_for(socket_path), os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600
    )
    with os.fdopen(log_fd, "ab") as log:  # the child keeps its own copy of the fd
        # A new session: the daemon outlives this shell and ignores its Ctrl-C.
        return subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )


def wait_until_ready(
    socket_path: Path,
    proc: subprocess.Popen[bytes],
    timeout_s: float,
    log_path: Path | None = None,
    on_status: Callable[[dict[str, Any] | None], None] | None = None,
) -> dict[str, Any]:
    """Poll a starting daemon until its model is loaded; its `status` body. Raises DaemonUnavailable
    (with the tail of its log) when it exits, fails to load, or is not ready in time. `on_status`
    sees every poll's answer (None before the daemon answers): the caller draws load progress."""
    log_path = log_path or log_path_for(socket_path)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise DaemonUnavailable(
                f"the daemon exited with code {proc.returncode} while starting:\n{_tail(log_path)}"
            )
        status = _status_or_none(socket_path)
        if on_status is not None:
            on_status(status)
        # `idle`: loaded once and released by its keep-alive; it serves (and reloads) on demand.
        if status is not None and status.get("state") in ("ready", "idle"):
            return status
        if status is not None and status.get("state") == "failed":
            raise DaemonUnavailable(f"the daemon could not load its model: {status.get('error')}")
        time.sleep(0.1)
    raise DaemonUnavailable(
        f"the daemon did not become ready within {timeout_s:.0f}s:\n{_tail(log_path)}"
    )


def _status_or_none(socket_path: Path) -> dict[str, Any] | None:
    try:
        with Client(socket_path, timeout=1.0) as client:
            return client.status()
    except DaemonUnavailable:
        return None


def _tail(path: Path) -> str:
    try:
        return path.read_text(errors="replace")[-2000:]
    except OSError:
        return ""
