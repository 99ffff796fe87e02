"""What the state directory says when no daemon answers, in words: the last crash, a run that
ended without a word (its marker left behind by a SIGKILL or an abort), the watchdog's last
action. Read by `moe status`; the daemon's own `status` carries the same crash record."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from .liveness import process_gone

CRASH_FILE = "crash.json"  # daemon/ground/crashlog.py writes it
WATCHDOG_FILE = "watchdog.json"  # daemon/ground/watchdog_state.py writes it


def _read(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None  # a misshapen file says nothing


def offline_state(state_dir: Path) -> dict[str, dict[str, Any] | None]:
    """`last_crash` (crash.json's last entry), `last_run` (the run marker of a daemon whose
    process is gone: it died before it could write a crash) and `watchdog` (its state, last
    action and when)."""
    out: dict[str, dict[str, Any] | None] = {}
    crash = _read(state_dir / CRASH_FILE)
    if crash is not None:
        last = crash.get("last")
        out["last_crash"] = last if isinstance(last, dict) else None
        run = crash.get("run")
        if isinstance(run, dict) and process_gone(run.get("pid")):
            out["last_run"] = run
    watchdog = _read(state_dir / WATCHDOG_FILE)
    if watchdog is not None:
        out["watchdog"] = {k: watchdog.get(k) for k in ("state", "last_action", "updated_at")}
    return out


def _when(at: Any) -> str:
    if isinstance(at, int | float) and not isinstance(at, bool):
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at))
    return "at an unknown time"


def describe_crash(entry: dict[str, Any]) -> str:
    """`out of memory at 2026-05-01 12:00:00 (pid 4242): <message>`."""
    kind = str(entry.get("kind") or "crash").replace("_", " ")
    pid = entry.get("pid")
    message = str(entry.get("message") or "").strip()
    return (
        f"{kind} at {_when(entry.get('at'))}"
        + (f" (pid {pid})" if pid is not None else "")
        + (f": {message}" if message else "")
    )


def describe_run(run: dict[str, Any]) -> str:
    """A run whose marker outlived its process: it was killed, aborted or lost power."""
    return (
        f"pid {run.get('pid')}, started {_when(run.get('started_at'))}, ended without a clean "
        "exit (killed, aborted or the machine lost power); the next start records it as a crash"
    )


def describe_watchdog(state: dict[str, Any]) -> str:
    action = state.get("last_action") or "none"
    when = _when(state.get("updated_at"))
    return f"{state.get('state') or 'unknown'}, last action {action} at {when}"


def offline_lines(state: dict[str, dict[str, Any] | None]) -> list[str]:
    """`moe status`'s lines for the state directory, one per thing it says."""
    lines = []
    if run := state.get("last_run"):
        lines.append(f"last run     {describe_run(run)}")
    if crash := state.get("last_crash"):
        lines.append(f"last crash   {describe_crash(crash)}")
    if watchdog := state.get("watchdog"):
        lines.append(f"watchdog     {describe_watchdog(watchdog)}")
    return lines
