"""What the watchdog did and why: a JSON-lines event log (its state file for `moe status` is
ground/watchdog_state.py, read by the daemon too).

The log is append-only, one line per decision, each written with a single write() on an O_APPEND
descriptor (so a crash never leaves half a line mid-file).
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from moed.daemon.ground.state_files import open_nofollow
from moed.daemon.ground.watchdog_state import jsonable

log = logging.getLogger("moed.watchdog")

EVENT_LOG_NAME = "watchdog.jsonl"
MAX_LOG_BYTES = 8 * 1024 * 1024  # rotated to .1 on open beyond this


def default_event_log(state_dir: Path) -> Path:
    return state_dir / EVENT_LOG_NAME


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
        line = json.dumps(record, default=jsonable, sort_keys=False) + "\n"
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
