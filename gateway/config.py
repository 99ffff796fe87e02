"""The gateway's configuration: parsed once from flags at the edge, passed down frozen."""

from __future__ import annotations

import ipaddress
import stat
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

DEFAULT_PORT = 11435  # beside ollama's 11434, so tools that speak to ollama find us one port up


def moed_version() -> str:
    try:
        return version("moed")
    except PackageNotFoundError:  # a source tree that was never installed
        return "0.0.0+source"


class ConfigError(ValueError):
    """A setting that cannot work; the CLI exits 2 with this message."""


@dataclass(frozen=True)
class GatewayConfig:
    socket: Path
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    api_key: str | None = None  # required off loopback; compared in constant time
    max_body_bytes: int = 4 * 1024 * 1024  # the daemon's frame limit: a larger prompt cannot pass
    max_connections: int = 64  # uvicorn answers 503 beyond this many concurrent connections
    keep_alive_s: int = 5
    request_timeout_s: float = 600.0  # a non-streamed answer that takes longer is cancelled
    daemon_timeout_s: float = 10.0  # control calls to the daemon (status, metrics, ...)
    # /health says "stalled" when a busy daemon made no progress this long.
    stall_after_s: float = 60.0
    cors_origins: tuple[str, ...] = ()  # browser origins allowed to call (chat UIs in a page)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def read_api_key(path: Path) -> str:
    """The key in `path` (first line, stripped). The file must not be readable by others."""
    try:
        mode = path.stat().st_mode
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"--api-key-file {path}: cannot read it ({exc.strerror})") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(
            f"--api-key-file {path}: mode {stat.S_IMODE(mode):o} lets others read it; chmod 600"
        )
    lines = text.strip().splitlines()
    key = lines[0].strip() if lines else ""
    if len(key) < 16:
        raise ConfigError(f"--api-key-file {path}: the key must be at least 16 characters")
    return key


def build_config(
    socket: Path, host: str, port: int, api_key_file: Path | None, **limits: float
) -> GatewayConfig:
    if not 0 <= port <= 65535:
        raise ConfigError(f"--port {port}: must be 0..65535")
    api_key = read_api_key(api_key_file) if api_key_file else None
    if not is_loopback(host) and not api_key:
        raise ConfigError(
            f"--host {host} is not a loopback address: anyone on the network could use the "
            "model; give --api-key-file (a file with the key, mode 600)"
        )
    return GatewayConfig(socket=socket, host=host, port=port, api_key=api_key, **limits)
