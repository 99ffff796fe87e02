"""Start and stop real `moed gateway` processes for end-to-end tests."""

from __future__ import annotations

import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from daemon_harness import moed_command


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class GatewayProcess:
    port: int
    proc: subprocess.Popen
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def gateway_command(daemon_socket: Path, port: int, *extra: str) -> list[str]:
    return moed_command("gateway", "--socket", str(daemon_socket), "--port", str(port), *extra)


def start_gateway(
    tmp: Path, daemon_socket: Path, *extra: str, headers: dict | None = None
) -> GatewayProcess:
    """A gateway process on a free loopback port, returned once GET /health answers."""
    tmp.mkdir(parents=True, exist_ok=True)
    port = free_port()
    log_path = tmp / f"gateway-{port}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            gateway_command(daemon_socket, port, *extra),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    gateway = GatewayProcess(port, proc, log_path)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the gateway exited with {proc.returncode}:\n{gateway.log()}")
        try:
            httpx.get(f"{gateway.url}/health", timeout=1.0, headers=headers)
            return gateway
        except httpx.TransportError:
            time.sleep(0.1)
    gateway.stop()
    raise RuntimeError(f"the gateway did not answer within 30s:\n{gateway.log()}")
