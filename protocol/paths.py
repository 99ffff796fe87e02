"""Per-user locations: the socket directory (mode 0700), the state directory and the log directory.

Shared by the daemon and its clients (the socket path is part of the protocol); imports no mlx.
"""

from __future__ import annotations

import errno
import os
import socket
import stat
import sys
import tempfile
import time
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


class UnsafeSocketPath(Exception):
    """The socket or its directory could be another user's: refuse, as ssh-agent and tmux do."""


def check_private_dir(path: Path) -> None:
    """The socket's directory must be a real directory, owned by this user, mode 0700."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise UnsafeSocketPath(f"socket directory {path} does not exist") from None
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeSocketPath(f"socket directory {path} is a symlink; refusing to use it")
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeSocketPath(f"socket directory {path} is not a directory")
    if st.st_uid != os.geteuid():
        raise UnsafeSocketPath(
            f"socket directory {path} is owned by uid {st.st_uid}, not by this user "
            f"(uid {os.geteuid()}); remove it or choose another --socket"
        )
    if st.st_mode & 0o077:
        raise UnsafeSocketPath(
            f"socket directory {path} has mode {stat.S_IMODE(st.st_mode):04o}; it must be 0700 "
            f"(only its owner may enter); fix it with chmod 700 or choose another --socket"
        )


def check_socket(socket_path: Path) -> None:
    """What a client checks before it sends anything: a private directory and a socket of ours."""
    check_private_dir(socket_path.parent)
    try:
        st = os.lstat(socket_path)
    except FileNotFoundError:
        return  # nobody listens: the connect says so
    if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.geteuid():
        raise UnsafeSocketPath(f"{socket_path} is not a socket owned by this user; refusing it")


def ensure_private_dir(path: Path) -> Path:
    """Create the socket's directory (mode 0700), or check an existing one; never chmod it.

    A directory this process did not create is used only if check_private_dir accepts it.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(path, 0o700)  # the umask can only clear bits of 0700
    except FileExistsError:
        pass
    check_private_dir(path)
    return path


def control_token_path(socket_path: Path) -> Path:
    """The owner's capability for `shed` and `shutdown`, beside the socket (mode 0600)."""
    return socket_path.with_name(socket_path.name + ".token")


def endpoint_for(socket_path: Path) -> str:
    text = str(socket_path)
    if len(text.encode()) > MAX_SOCKET_PATH:
        raise ValueError(
            f"socket path is {len(text.encode())} bytes, "
            f"over the {MAX_SOCKET_PATH}-byte limit: {text}"
        )
    return f"ipc://{text}"


# A refused connect is retried this many times, this far apart: on macOS a full listen backlog
# (a frozen daemon, many clients) is refused too, and one retry tells it from a dead socket.
REFUSED_TRIES = 3
REFUSED_RETRY_S = 0.02


def nobody_listens(socket_path: Path) -> bool:
    """Whether no process listens on the socket: the file is missing, or a connect is refused,
    as it is at once once the daemon that bound it exited, was killed or is a zombie (its socket
    closed with its files). A live daemon, even a frozen one, accepts the connect: False."""
    for attempt in range(REFUSED_TRIES):
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(1.0)
        try:
            probe.connect(str(socket_path))
            return False
        except (FileNotFoundError, NotADirectoryError):
            return True
        except OSError as exc:
            if exc.errno != errno.ECONNREFUSED:
                return False  # a full backlog on Linux, a timeout: someone is there
        finally:
            probe.close()
        if attempt + 1 < REFUSED_TRIES:
            time.sleep(REFUSED_RETRY_S)
    return True
