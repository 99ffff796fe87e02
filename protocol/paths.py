"""Per-user locations: the socket directory (mode 0700), the state directory and the log directory.

Shared by the daemon and its clients (the socket path is part of the protocol); imports no mlx.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

# macOS limits AF_UNIX paths to 104 bytes; keep the default short and refuse long ones early.
MAX_SOCKET_PATH = 100


def runtime_dir() -> Path:
    if env := os.environ.get("MOED_RUNTIME_DIR"):
        return Path(env)
    # $TMPDIR on macOS is a long /var/folders path; /tmp keeps the socket path short.
    base = (
        Path("/tmp")
        if sys.platform == "darwin"
        else Path(os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir())
    )
    return base / f"moed-{os.getuid()}"


def default_socket_path() -> Path:
    if env := os.environ.get("MOED_SOCKET"):
        return Path(env)
    return runtime_dir() / "moed.sock"


def state_dir() -> Path:
    if env := os.environ.get("MOED_STATE_DIR"):
        return Path(env)
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Application Support" / "moed"
    return Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / "moed"


def log_dir() -> Path:
    if env := os.environ.get("MOED_LOG_DIR"):
        return Path(env)
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Logs" / "moed"
    return state_dir() / "logs"


def config_path() -> Path:
    if env := os.environ.get("MOED_CONFIG"):
        return Path(env)
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Application Support" / "moed" / "config.toml"
    return (
        Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config") / "moed" / "config.toml"
    )


def ensure_private_dir(path: Path) -> Path:
    """Create a directory readable only by this user (the socket's directory guards the socket)."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    if path.stat().st_uid == os.getuid():
        os.chmod(path, 0o700)
    return path


def endpoint_for(socket_path: Path) -> str:
    text = str(socket_path)
    if len(text.encode()) > MAX_SOCKET_PATH:
        raise ValueError(
            f"socket path is {len(text.encode())} bytes, "
            f"over the {MAX_SOCKET_PATH}-byte limit: {text}"
        )
    return f"ipc://{text}"
