"""The watchdog's state file (`watchdog.json` in the state directory): written by the watchdog,
read by it and by the daemon's `status`. Rewritten atomically (temp file + rename), so a reader
never sees a torn file."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import psutil

from moed.daemon.ground.state_files import read_json, save_json

STATE_FILE_NAME = "watchdog.json"
# Written by the daemon, read by the watchdog: the daemon's last recovery in place from a device
# failure (engine/recovery.py). The watchdog counts an out-of-memory one as the shed step it would
# have taken itself, so one event is not met twice, and keeps what it saw in its state file.
RECOVERY_FILE_NAME = "recovery.json"


def state_file_path(state_dir: Path) -> Path:
    return state_dir / STATE_FILE_NAME


def jsonable(value: Any) -> Any:
    """`json.dumps`'s default for the watchdog's records: enums by value, paths as text."""
    if hasattr(value, "value") and not isinstance(value, (int, float, str)):
        return value.value  # enums
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


def write_state(path: Path, state: dict) -> None:
    save_json(path, json.loads(json.dumps(state, default=jsonable)))


def _state_shape(state) -> bool:
    numbers = ("updated_at", "heartbeat_s")
    return isinstance(state, dict) and all(
        state.get(k) is None
        or (isinstance(state[k], (int, float)) and not isinstance(state[k], bool))
        for k in numbers
    )


def read_state(state_dir: Path, stale_after_s: float = 30.0) -> dict | None:
    """The watchdog's last published state, with `running` judged from its pid and freshness."""
    state = read_json(state_file_path(state_dir), shape=_state_shape)
    if state is None:
        return None
    pid = state.get("pid")
    alive = isinstance(pid, int) and psutil.pid_exists(pid)
    fresh = time.time() - float(state.get("updated_at") or 0) <= max(
        stale_after_s, 3 * float(state.get("heartbeat_s") or 0)
    )
    state["running"] = bool(alive and fresh and not state.get("stopped_at"))
    return state


def report_recovery(state_dir: Path, record: dict) -> None:
    """The daemon recovered in place (its pid, boot id and the recovery's record)."""
    save_json(state_dir / RECOVERY_FILE_NAME, json.loads(json.dumps(record, default=jsonable)))


def _recovery_shape(record: Any) -> bool:
    at = record.get("at") if isinstance(record, dict) else None
    return isinstance(at, (int, float)) and not isinstance(at, bool)


def read_recovery(state_dir: Path) -> dict | None:
    """The daemon's last recovery in place, or None."""
    record: dict | None = read_json(state_dir / RECOVERY_FILE_NAME, shape=_recovery_shape)
    return record
