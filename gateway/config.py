"""The gateway's configuration: parsed once from flags at the edge, passed down frozen."""

from __future__ import annotations

import ipaddress
import os
import secrets
import stat
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from moed.protocol.paths import UnsafeSocketPath, ensure_private_dir

from .peer import LocalAuth

DEFAULT_PORT = 11435  # beside ollama's 11434, so tools that speak to ollama find us one port up


def moed_version() -> str:
    try:
        return version("moed")
    except PackageNotFoundError:  # a source tree that was never installed
        return "0.0.0+source"


class ConfigError(ValueError):
    """A setting that cannot work; the CLI exits 2 with this message."""


@dataclass(frozen=True)
class ConnectionLimits:
    """Below HTTP: open sockets, and how long and large a request's headers may be."""

    max_open: int = 512  # open sockets in all (each costs a file descriptor)
    max_open_per_client: int = 256
    header_timeout_s: float = 10.0  # from the connection (or the previous answer) to a request
    body_idle_s: float = 30.0  # the longest pause between two pieces of a request's body
    max_header_bytes: int = 64 * 1024


@dataclass(frozen=True)
class GatewayConfig:
    socket: Path
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    # The keys clients may send (required off loopback; compared in constant time). Several (an
    # --api-key-file of one key a line): each is a principal the prefix cache keeps apart.
    api_keys: tuple[str, ...] = ()
    # With --local-auth off: each other local user (by uid) is a principal of their own.
    principals_by_uid: bool = False
    max_body_bytes: int = 4 * 1024 * 1024  # the daemon's frame limit: a larger prompt cannot pass
    max_connections: int = 64  # API requests in flight (then 429); /health is never counted
    max_requests_per_client: int = 48  # from one client address, so others keep some room
    connections: ConnectionLimits = ConnectionLimits()  # sockets, header deadline and size
    keep_alive_s: int = 5
    request_timeout_s: float = 600.0  # a non-streamed answer that takes longer is cancelled
    # Any request whose answer has not started by then is cancelled and answered 504.
    answer_timeout_s: float = 605.0
    daemon_timeout_s: float = 10.0  # control calls to the daemon (status, metrics, ...)
    # /health says "stalled" when a busy daemon made no progress this long.
    stall_after_s: float = 60.0
    cors_origins: tuple[str, ...] = ()  # browser origins allowed to call (chat UIs in a page)
    allowed_hosts: tuple[str, ...] = ()  # Host names served besides the loopback ones
    local_auth: LocalAuth = LocalAuth.UID  # resolved; without a key, who on this host is served
    access_log: bool = True  # one line per request (--quiet turns it off)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped  # a dual-stack listener's IPv4 client: ::ffff:127.0.0.1
    return ip.is_loopback


def read_api_key(path: Path) -> str:
    """The key in `path` (first line, stripped). The file must not be readable by others."""
    return read_api_keys(path)[0]


def read_api_keys(path: Path) -> tuple[str, ...]:
    """The keys in `path`, one a line (stripped; blank lines and `#` comments skipped), each at
    least 16 characters and none twice. The file must not be readable by others."""
    try:
        mode = path.stat().st_mode
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"--api-key-file {path}: cannot read it ({exc.strerror})") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(
            f"--api-key-file {path}: mode {stat.S_IMODE(mode):o} lets others read it; chmod 600"
        )
    keys = [k for k in (line.strip() for line in text.splitlines()) if k and k[0] != "#"]
    if not keys:
        raise ConfigError(f"--api-key-file {path}: the key must be at least 16 characters")
    for n, key in enumerate(keys, 1):
        if len(key) < 16:
            raise ConfigError(f"--api-key-file {path}: key {n} must be at least 16 characters")
    if len(set(keys)) != len(keys):
        raise ConfigError(f"--api-key-file {path}: a key is given twice")
    return tuple(keys)


def gateway_key_path(socket: Path) -> Path:
    """Where LocalAuth.KEY keeps its key: beside the daemon's socket, in its 0700 directory."""
    return socket.parent / "gateway.key"


def write_gateway_key(path: Path) -> str:
    """A new key in `path`, mode 0600, written atomically (clients read it as their API key); a
    symlink or someone else's file there is replaced, never followed."""
    key = secrets.token_urlsafe(32)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(key + "\n")
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise ConfigError(f"cannot write the gateway key {path}: {exc.strerror}") from None
    return key


def _reuse_gateway_key(path: Path) -> str | None:
    """The key a previous start wrote, if it is still this user's own private file (clients keep
    working across restarts); anything else is replaced."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
        return None
    try:
        return read_api_key(path)
    except ConfigError:
        return None


def build_config(
    socket: Path,
    host: str,
    port: int,
    api_key_file: Path | None,
    local_auth: LocalAuth = LocalAuth.AUTO,
    **limits,
) -> GatewayConfig:
    if not 0 <= port <= 65535:
        raise ConfigError(f"--port {port}: must be 0..65535")
    api_keys = read_api_keys(api_key_file) if api_key_file else ()
    local_auth = local_auth.resolved()
    if not api_keys and local_auth is LocalAuth.KEY:
        try:  # the daemon's own 0700 directory (made now if the daemon has not started yet)
            ensure_private_dir(socket.parent)
        except (OSError, UnsafeSocketPath) as exc:
            raise ConfigError(f"--local-auth key: {exc}") from None
        api_keys = (
            _reuse_gateway_key(gateway_key_path(socket))
            or write_gateway_key(gateway_key_path(socket)),
        )
    if not is_loopback(host) and not api_keys:
        raise ConfigError(
            f"--host {host} is not a loopback address: anyone on the network could use the "
            "model; give --api-key-file (a file with the key, mode 600)"
        )
    config = GatewayConfig(
        socket=socket,
        host=host,
        port=port,
        api_keys=api_keys,
        principals_by_uid=not api_keys and local_auth is LocalAuth.OFF,
        local_auth=local_auth,
        **limits,
    )
    sockets = config.connections
    # Sockets beyond the requests in flight are the room /health is answered in.
    if sockets.max_open <= config.max_connections:
        raise ConfigError(
            f"--max-open-connections {sockets.max_open} must exceed --max-connections "
            f"{config.max_connections} (room for /health)"
        )
    if sockets.max_open_per_client <= config.max_requests_per_client:
        raise ConfigError(
            f"--max-open-per-client {sockets.max_open_per_client} must exceed "
            f"--max-requests-per-client {config.max_requests_per_client} (room for /health)"
        )
    return config
