"""What the watchdog did and why: a JSON-lines event log and a state file for `moe status`.

The log is append-only, one line per decision, each written with a single write() on an O_APPEND
descriptor (so a crash never leaves half a line mid-file). The state file is rewritten atomically
(temp file + rename) so a reader never sees a torn file.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import psutil

from moed.daemon.runtime.state_files import open_nofollow, read_json, save_json

log = logging.getLogger("moed.watchdog")

EVENT_LOG_NAME = "watchdog.jsonl"
STATE_FILE_NAME = "watchdog.json"
MAX_LOG_BYTES = 8 * 1024 * 1024  # rotated to .1 on open beyond this


def default_event_log(state_dir: Path) -> Path:
    return state_dir / EVENT_LOG_NAME


def state_file_path(state_dir: Path) -> Path:
    return state_dir / STATE_FILE_NAME


def _jsonable(value: Any) -> Any:
    if hasattr(value, "value") and not isinstance(value, (int, float, str)):
        return value.value  # enums
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


class EventLog:
    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            if path.stat().st_size > MAX_LOG_BYTES:
                os.replace(path, path.with_name(path.name + ".1"))
        except FileNotFoundError:
            pass
        try:
            self._fd = open_nofollow(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        except OSError as exc:  # a symlink planted in its place, a read-only dir: advisory, go on
            log.warning(
                "watchdog event log %s cannot be opened (%s); events go unlogged", path, exc
            )
            self._fd = -1
            return
        if _ends_mid_line(path):  # a writer died mid-line: end it, so our first line stands alone
            os.write(self._fd, b"\n")

    def write(self, event: str, **fields: Any) -> dict:
        now = time.time()
        record = {
            "ts": round(now, 3),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(now)),
            "event": event,
            **fields,
        }
        line = json.dumps(record, default=_jsonable, sort_keys=False) + "\n"
        if self._fd >= 0:
            try:
                os.write(self._fd, line.encode())
            except OSError as exc:  # a full disk must not stop the guard
                log.warning("watchdog event not logged: %s", exc)
        return record

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> EventLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _ends_mid_line(path: Path) -> bool:
    with open(path, "rb") as f:
        if f.seek(0, os.SEEK_END) == 0:
            return False
        f.seek(-1, os.SEEK_END)
        return f.read(1) != b"\n"


def read_events(path: Path) -> list[dict]:
    """Every complete line of an event log (a torn last line, if any, is skipped)."""
    out = []
    try:
        text = path.read_text()
    except FileNotFoundError:
        return out
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def write_state(path: Path, state: dict) -> None:
    save_json(path, json.loads(json.dumps(state, default=_jsonable)))


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
