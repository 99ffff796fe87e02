"""Start and stop real `moed serve` processes for end-to-end tests (no mocks: a real daemon)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from moed.client import Client, DaemonUnavailable, DoneEvent, RequestFailed, TokenEvent
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


def run_together(
    daemon, requests: list[dict], max_tokens: int = 12, on_token=None, **common
) -> list:
    """Send every request from its own client at once (`daemon.client()`); each one's (token ids,
    end event or RequestFailed). A request's own `max_tokens` wins over the common one;
    `on_token(n, client, tokens so far)` runs on each of request n's tokens."""
    results: list = [None] * len(requests)
    ready = threading.Barrier(len(requests))

    def worker(n: int) -> None:
        got: list[int] = []
        with daemon.client() as c:
            c.connect()
            ready.wait()
            try:
                for event in c.generate(**{"max_tokens": max_tokens, **requests[n], **common}):
                    if isinstance(event, TokenEvent):
                        got += event.ids
                        if on_token is not None:
                            on_token(n, c, got)
                    elif isinstance(event, DoneEvent):
                        results[n] = (got, event)
            except RequestFailed as exc:
                results[n] = (got, exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return results


class Supervisor:
    """Runs `moed serve` and restarts it like KeepAlive: again after a crash, not after exit 0."""

    def __init__(
        self,
        tmp: Path,
        model: Path,
        *serve_args: str,
        env: dict | None = None,
        throttle_s: float = 0.2,
    ):
        self.tmp = tmp
        self.socket = short_socket_path()
        self.state_dir = tmp / "state"
        self.args = serve_command(model, self.socket, self.state_dir, *serve_args)
        self.env = {**os.environ, "MOED_LOG_DIR": str(tmp / "logs"), **(env or {})}
        self.throttle_s = throttle_s
        self.exits: list[int] = []  # return codes in order (negative: killed by that signal)
        self.logs: list[Path] = []
        self.proc: subprocess.Popen | None = None
        self._stop = threading.Event()
        self.finished = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> Supervisor:
        self._thread.start()
        return self

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                log = self.tmp / f"daemon-{len(self.logs)}.log"
                self.logs.append(log)
                with open(log, "wb") as out:
                    # No core dumps, as the service units say (LimitCORE=0); ulimit is fork-safe
                    # here.
                    self.proc = subprocess.Popen(
                        ["sh", "-c", 'ulimit -c 0; exec "$@"', "sh", *self.args],
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        env=self.env,
                        start_new_session=True,
                    )
                if self._stop.is_set():  # stop() may have looked at the previous, dead process
                    self.proc.kill()
                code = self.proc.wait()
                self.exits.append(code)
                if code == 0 or self._stop.is_set():
                    return
                time.sleep(self.throttle_s)
        finally:
            self.finished.set()

    def wait_ready(self, not_boot: str | None = None, timeout_s: float = 60.0) -> dict:
        """The status of a ready daemon (one whose boot differs from `not_boot`, if given)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                with Client(self.socket, timeout=1.0) as c:
                    st = c.status()
                if st["state"] == "ready" and st["boot_id"] != not_boot:
                    return st
            except DaemonUnavailable:
                pass
            if self.finished.is_set():
                raise RuntimeError(f"the supervisor stopped: exits {self.exits}\n{self.log_text()}")
            time.sleep(0.05)
        raise TimeoutError(
            f"no ready daemon in {timeout_s}s; exits {self.exits}\n{self.log_text()}"
        )

    def client(self, **kwargs) -> Client:
        return Client(self.socket, **kwargs)

    def log_text(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')}" for p in self.logs if p.exists()
        )

    def stop(self) -> None:
        self._stop.set()
        if self.proc is not None:
            stop_process(self.proc)
        self._thread.join(20)
        shutil.rmtree(self.socket.parent, ignore_errors=True)
