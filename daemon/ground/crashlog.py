"""The daemon's crash record (`crash.json` in the state directory), written atomically.

What survives a crash: the last crash (kind, message, time, boot), the recent history (for the
restart budget and the cache backoff) and a marker of the run in progress, so that a start after
an abort or a SIGKILL, which leave no chance to write anything, still knows the previous run died.

- Backoff: each memory crash (out_of_memory, or an unclean exit, which is how older MLX reports a
  Metal OOM) within the window halves the next start's cache budget, down to 1/8. Crashes older
  than the window drop out, so a stable period restores the full budget.
- Poison requests: the transport writes the fingerprints of the generations in flight
  (`inflight.json`) before the engine sees them; a crash keeps them in its entry, and a request
  that was in flight at two crashes within the window is refused, not replayed.
- Restart budget: `restart_budget` crashes within `restart_window_s` and the daemon refuses to
  start, exiting 0 so that launchd (KeepAlive SuccessfulExit=false) and systemd (Restart=on-failure)
  stop restarting it; the log says why and how to start again.
"""

from __future__ import annotations

import enum
import hashlib
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from moed.daemon.ground.state_files import read_json, save_json
from moed.protocol import encode

CRASH_FILE = "crash.json"
INFLIGHT_FILE = "inflight.json"
POISON_AFTER = 2  # crashes with the same request in flight before it is refused
BACKOFF_STEP = 0.5
BACKOFF_FLOOR = 0.125
MAX_HISTORY = 50


class CrashKind(str, enum.Enum):
    OUT_OF_MEMORY = "out_of_memory"  # a Metal command-buffer failure raised as a Python error
    UNCLEAN_EXIT = (
        "unclean_exit"  # the previous run vanished: abort (older MLX's OOM), SIGKILL, power
    )
    LOAD_FAILED = "load_failed"  # the model could not load (counts for the restart budget only)
    ENGINE_FAILED = "engine_failed"  # the engine died otherwise, or stayed stuck through a drain
    RANK_FAILED = "rank_failed"  # another pipeline rank died or stalled (no budget backoff)
    MEMORY_PRESSURE = (
        "memory_pressure"  # the watchdog asked for a restart because swap kept growing
    )
    # Not a crash: an out-of-memory recovered in place (engine/recovery.py). Kept in the history
    # for the back-off only, so a start within the window takes no larger budget than it left.
    RECOVERED_OOM = "recovered_out_of_memory"


MEMORY_KINDS = frozenset(
    {
        CrashKind.OUT_OF_MEMORY,
        CrashKind.UNCLEAN_EXIT,
        CrashKind.MEMORY_PRESSURE,
        CrashKind.RECOVERED_OOM,
    }
)
# Another rank's death says nothing about this daemon or the requests it had in flight: it spends
# no restart budget and never makes a request poison (the group restart is the retry).
NOT_THE_DAEMONS_OWN = frozenset({CrashKind.RANK_FAILED.value})
# The daemon survived these: no restart budget spent, no request made poison, never `last`.
NOT_A_CRASH = frozenset({CrashKind.RECOVERED_OOM.value})


def crash_path(state_dir: Path) -> Path:
    return Path(state_dir) / CRASH_FILE


def _is_entry(entry: Any) -> bool:
    return (
        isinstance(entry, dict)
        and isinstance(entry.get("kind"), str)
        and isinstance(entry.get("at"), (int, float))
        and not isinstance(entry.get("at"), bool)
    )


def _crash_file_shape(data: Any) -> bool:
    """What plan_start relies on; anything else is set aside, not half-trusted."""
    history = data.get("history", [])
    return (
        isinstance(data, dict)
        and isinstance(history, list)
        and all(_is_entry(e) for e in history)
        and (data.get("last") is None or _is_entry(data["last"]))
        and (data.get("run") is None or isinstance(data["run"], dict))
    )


def _load(state_dir: Path) -> dict:
    return read_json(crash_path(state_dir), default={}, shape=_crash_file_shape)


def _save(state_dir: Path, data: dict) -> None:
    data["history"] = data.get("history", [])[-MAX_HISTORY:]
    save_json(crash_path(state_dir), data)


@dataclass(frozen=True)
class StartPlan:
    last_crash: dict | None  # reported in `welcome` and `status`
    budget_factor: float  # multiply the cache budget by this
    recent_crashes: int  # within the window
    refuse: str | None  # set: the restart budget is spent; exit 0 with this message
    unclean_previous: dict | None  # the previous run, if it died without a word
    poison: frozenset[str] = (
        frozenset()
    )  # fingerprints of requests in flight at POISON_AFTER crashes

    def describe(self) -> dict:
        return {"factor": self.budget_factor, "recent_crashes": self.recent_crashes}


def plan_start(
    state_dir: Path, restart_budget: int, window_s: float, now: float | None = None, pid_alive=None
) -> StartPlan:
    """Read the record at start: note an unclean previous exit, then judge backoff and budget."""
    now = time.time() if now is None else now
    pid_alive = pid_alive or psutil.pid_exists
    data = _load(state_dir)
    unclean = None
    run = data.get("run")
    if isinstance(run, dict) and not (
        isinstance(run.get("pid"), int) and run["pid"] != os.getpid() and pid_alive(run["pid"])
    ):
        # The run marker is cleared on every exit the daemon controls; one left behind means a
        # death.
        unclean = run
        entry = _entry(
            CrashKind.UNCLEAN_EXIT,
            "the previous run ended without a clean exit (abort, SIGKILL or power loss)",
            run.get("boot_id"),
            run.get("pid"),
            now,
        )
        entry["started_at"] = run.get("started_at")
        entry["inflight"] = _inflight(state_dir, run.get("boot_id"))
        data.setdefault("history", []).append(entry)
        data["last"] = entry
        data.pop("run", None)
        _save(state_dir, data)
    within = [e for e in data.get("history", []) if now - float(e["at"]) <= window_s]
    recent = [e for e in within if e.get("kind") not in NOT_THE_DAEMONS_OWN | NOT_A_CRASH]
    memory = [e for e in within if e.get("kind") in {k.value for k in MEMORY_KINDS}]
    factor = backoff_factor(len(memory))
    refuse = None
    if restart_budget > 0 and len(recent) >= restart_budget:
        first = min(float(e["at"]) for e in recent)
        wait = max(0.0, first + window_s - now)
        refuse = (
            f"{len(recent)} crashes in the last {window_s / 60:.0f} minutes "
            f"(restart budget {restart_budget}); "
            "not starting, so the service manager stops restarting. "
            f"Last: {recent[-1].get('kind')}: "
            f"{recent[-1].get('message')}. "
            f"Fix the cause, then start again in {wait / 60:.0f} minutes "
            f"or after removing {crash_path(state_dir)}"
        )
    return StartPlan(data.get("last"), factor, len(recent), refuse, unclean, _poison(recent))


def begin_run(
    state_dir: Path, boot_id: str, pid: int | None = None, budget: dict | None = None
) -> None:
    data = _load(state_dir)
    data["run"] = {
        "boot_id": boot_id,
        "pid": pid or os.getpid(),
        "started_at": time.time(),
        "budget": budget,
    }
    _save(state_dir, data)


def end_run(state_dir: Path, boot_id: str) -> None:
    """A clean exit (or one already recorded as a crash): the run marker goes."""
    data = _load(state_dir)
    run = data.get("run")
    if isinstance(run, dict) and run.get("boot_id") == boot_id:
        data.pop("run")
        _save(state_dir, data)


def record_crash(
    state_dir: Path, kind: CrashKind, message: str, boot_id: str | None, extra: dict | None = None
) -> dict:
    """Write the crash before anything else happens (the process is about to exit)."""
    data = _load(state_dir)
    entry = _entry(kind, message, boot_id, os.getpid(), time.time())
    entry["inflight"] = _inflight(state_dir, boot_id)
    if extra:
        entry.update(extra)
    data.setdefault("history", []).append(entry)
    data["last"] = entry
    run = data.get("run")
    if isinstance(run, dict) and run.get("boot_id") == boot_id:
        data.pop("run")  # accounted for: the next start must not count it again as unclean
    _save(state_dir, data)
    return entry


def record_recovery(state_dir: Path, recovery: dict, boot_id: str | None) -> None:
    """An out-of-memory recovered in place (engine/recovery.py): into the history, for the next
    start's back-off; the run goes on, so neither `last` nor the run marker changes."""
    data = _load(state_dir)
    entry = _entry(
        CrashKind.RECOVERED_OOM, str(recovery.get("message", "")), boot_id, os.getpid(), time.time()
    )
    entry["shed"] = recovery.get("shed")
    data.setdefault("history", []).append(entry)
    _save(state_dir, data)


def _entry(kind: CrashKind, message: str, boot_id: Any, pid: Any, at: float) -> dict:
    return {
        "kind": kind.value,
        "message": message[:2000],
        "boot_id": boot_id,
        "pid": pid,
        "at": at,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(at)),
    }


def fingerprint(request: dict) -> str:
    """What identifies a generate request across clients and restarts: everything but its id."""
    body = {k: request[k] for k in sorted(request) if k not in ("id", "trace", "telemetry_every")}
    return hashlib.sha256(encode(body)).hexdigest()[:32]


def write_inflight(state_dir: Path, boot_id: str, fingerprints: list[str]) -> None:
    """The requests in flight now; no fsync: it must outlive a crash, not a power loss."""
    save_json(
        Path(state_dir) / INFLIGHT_FILE,
        {"boot_id": boot_id, "requests": fingerprints},
        durable=False,
    )


def _inflight(state_dir: Path, boot_id: Any) -> list[str]:
    data = read_json(Path(state_dir) / INFLIGHT_FILE, default={})
    if not isinstance(data, dict) or data.get("boot_id") != boot_id:
        return []
    requests = data.get("requests")
    return [r for r in requests if isinstance(r, str)] if isinstance(requests, list) else []


def _poison(recent: list[dict]) -> frozenset[str]:
    seen: dict[str, int] = {}
    for entry in recent:
        if entry.get("kind") in NOT_THE_DAEMONS_OWN | {CrashKind.MEMORY_PRESSURE.value}:
            continue  # a watchdog's restart or a lost rank says nothing about the requests
        inflight = entry.get("inflight")
        for fp in set(inflight) if isinstance(inflight, list) else ():
            if isinstance(fp, str):
                seen[fp] = seen.get(fp, 0) + 1
    return frozenset(fp for fp, n in seen.items() if n >= POISON_AFTER)


def backoff_factor(memory_failures: int) -> float:
    """The share of the budget left after `memory_failures` (each halves it, down to 1/8)."""
    return max(BACKOFF_FLOOR, BACKOFF_STEP**memory_failures)


def scale_budget(budget_bytes: int, factor: float) -> int:
    return max(1, int(budget_bytes * factor))
