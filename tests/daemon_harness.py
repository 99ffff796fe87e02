"""Start and stop real `moed serve` processes for end-to-end tests (no mocks: a real daemon)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from moed.client import Client
from moed.client.autostart import wait_until_ready


@dataclass
class DaemonProcess:
    socket: Path
    state_dir: Path
    log_path: Path
    proc: subprocess.Popen
    args: list[str] = field(default_factory=list)

    def client(self, **kwargs) -> Client:
        return Client(self.socket, **kwargs)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout_s: float = 60.0) -> dict:
        return wait_until_ready(self.socket, self.proc, timeout_s, self.log_path)

    def stop(self, timeout_s: float = 15.0) -> int:
        code = stop_process(self.proc, timeout_s)
        shutil.rmtree(self.socket.parent, ignore_errors=True)  # the short-path socket dir in /tmp
        return code


def stop_process(proc: subprocess.Popen, timeout_s: float = 15.0) -> int:
    """SIGTERM, then SIGKILL if it has not exited within timeout_s; its exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def short_socket_path() -> Path:
    """A socket in its own new folder under /tmp: AF_UNIX paths are limited to about 100 bytes."""
    return Path(f"/tmp/moedt-{os.getpid()}-{time.monotonic_ns() % 10**9}") / "d.sock"


def moe_command(socket: Path, *args: str) -> list[str]:
    """`moe --socket SOCKET ARGS...` with this interpreter."""
    return [sys.executable, "-m", "moed.client.cli", "--socket", str(socket), *args]


def moed_command(*args: str) -> list[str]:
    """`moed ARGS...` with this interpreter."""
    return [sys.executable, "-m", "moed.daemon.cli", *args]


def moe(
    socket: Path,
    *args: str,
    input: str | None = None,
    env: dict | None = None,
    timeout: float = 120,
) -> subprocess.CompletedProcess:
    """Run `moe` to completion: text output captured, env added to this process's."""
    return run_captured(moe_command(socket, *args), input=input, env=env, timeout=timeout)


def moed(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run `moed` to completion: text output captured, env added to this process's."""
    return run_captured(moed_command(*args), env=env, timeout=timeout)


def run_captured(
    cmd: list[str], *, input: str | None = None, env: dict | None = None, timeout: float = 120
) -> subprocess.CompletedProcess:
    """Run to completion with text output captured; env is added to this process's."""
    return subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        input=input,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def watchdog_command(socket: Path, state_dir: Path, *extra: str) -> list[str]:
    return moed_command("watchdog", "--socket", str(socket), "--state-dir", str(state_dir), *extra)


def start_watchdog(socket: Path, state_dir: Path, log_path: Path, *extra: str) -> subprocess.Popen:
    """A `moed watchdog` process writing to log_path; stop it with stop_process."""
    with open(log_path, "wb") as log:
        return subprocess.Popen(
            watchdog_command(socket, state_dir, *extra),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def serve_command(model: Path | str, socket: Path, state_dir: Path, *extra: str) -> list[str]:
    return moed_command(
        "serve",
        "--model",
        str(model),
        "--socket",
        str(socket),
        "--state-dir",
        str(state_dir),
        *extra,
    )


def start_daemon(
    tmp: Path,
    model: Path | str,
    *extra: str,
    env: dict | None = None,
    wait: bool = True,
    preexec_fn=None,
) -> DaemonProcess:
    tmp.mkdir(parents=True, exist_ok=True)
    socket = short_socket_path()
    state_dir = tmp / "state"
    log_path = tmp / f"daemon-{time.monotonic_ns()}.log"
    args = serve_command(model, socket, state_dir, *extra)
    full_env = {**os.environ, "MOED_LOG_DIR": str(tmp / "logs"), **(env or {})}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            args,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=full_env,
            start_new_session=True,
            preexec_fn=preexec_fn,
        )
    daemon = DaemonProcess(socket, state_dir, log_path, proc, args)
    if wait:
        try:
            daemon.wait_ready()
        except BaseException:
            daemon.stop()
            raise
    return daemon
