"""State files: written atomically (temporary file, fsync, rename), read without following symlinks.

State is advisory. A file that is not JSON, or JSON of the wrong shape, is set aside as
`<name>.corrupt` with a warning and reads as the default; a state directory that cannot be written
means no persistence, with one warning per file, never a failed request or a dead daemon.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger("moed.state")
_warned: set[str] = set()  # one warning per unwritable file, not one per request


def open_nofollow(path: Path, flags: int, mode: int = 0o600) -> int:
    """os.open that refuses a symlink at the last component (side files never follow one)."""
    return os.open(path, flags | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), mode)


def write_atomic(path: Path, data: bytes, durable: bool = True) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)  # replaces a symlink itself, never writes through it
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    if not durable:
        return
    # The rename is durable only once the directory entry is.
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def write_json_atomic(path: Path, value: Any, durable: bool = True) -> None:
    write_atomic(path, json.dumps(value, indent=2, sort_keys=True).encode(), durable)


def save_json(path: Path, value: Any, durable: bool = True) -> bool:
    """write_json_atomic that warns instead of raising (a read-only or full state directory)."""
    try:
        write_json_atomic(path, value, durable)
        return True
    except OSError as exc:
        if str(path) not in _warned:
            _warned.add(str(path))
            log.warning("state file %s cannot be written (%s); continuing without it", path, exc)
        return False


def read_json(path: Path, default: Any = None, shape: Callable[[Any], bool] | None = None) -> Any:
    """Read a state file; missing reads as the default, corrupt or misshapen is set aside."""
    try:
        fd = open_nofollow(path, os.O_RDONLY)
    except FileNotFoundError:
        return default
    except OSError as exc:  # a symlink (ELOOP), no permission: not ours to read
        log.warning("state file %s is not readable (%s); ignoring it", path, exc)
        return default
    try:
        with os.fdopen(fd, "rb") as f:
            raw = f.read()
    except OSError as exc:
        log.warning("state file %s is not readable (%s); ignoring it", path, exc)
        return default
    try:
        value = json.loads(raw)
    except ValueError:
        return _set_aside(path, "not JSON", default)
    if shape is not None and not _fits(shape, value):
        return _set_aside(path, "JSON of the wrong shape", default)
    return value


def _fits(shape: Callable[[Any], bool], value: Any) -> bool:
    try:
        return bool(shape(value))
    except (TypeError, ValueError, KeyError, AttributeError):
        return False


def _set_aside(path: Path, why: str, default: Any) -> Any:
    corrupt = path.with_name(path.name + ".corrupt")
    try:
        os.replace(path, corrupt)
        log.warning("state file %s is %s; set aside as %s", path, why, corrupt)
    except OSError as exc:
        log.warning("state file %s is %s and cannot be set aside (%s); ignoring it", path, why, exc)
    return default
