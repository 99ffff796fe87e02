"""The progress deadline: liveness is not progress. A daemon that answers pings while its engine
makes no progress says `stalled`, and its clients get a retryable `engine_stalled` instead of
waiting forever, with or without the watchdog (which may then restart it)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any


@dataclass
class ProgressMonitor:
    deadline_s: float
    busy_since: float | None = None  # wall time the transport first had work after being idle
    stalled_at: float | None = None  # wall time the deadline passed; None while progressing

    def work_admitted(self, idle_before: bool, now: float | None = None) -> None:
        if idle_before or self.busy_since is None:
            self.busy_since = time.time() if now is None else now

    def last_progress(self, snapshot: dict[str, Any]) -> float | None:
        """The engine's last sign of progress: a token, a prompt chunk, a layer of one or an expert
        read inside a step (engine/heartbeat.py), a finished (re)load, or new work arriving."""
        marks = [
            snapshot.get("last_token_at"),
            snapshot.get("last_progress_at"),
            snapshot.get("last_activity_at"),
            self.busy_since,
        ]
        times: list[float] = [m for m in marks if isinstance(m, (int, float))]
        return max(times) if times else None

    def check(self, snapshot: dict[str, Any], has_work: bool, now: float | None = None) -> bool:
        """True when the engine, with work to do, made no progress within the deadline."""
        now = time.time() if now is None else now
        last = self.last_progress(snapshot)
        if self.stalled_at is not None and last is not None and last > self.stalled_at:
            self.stalled_at = None  # it moved again
        busy = has_work or bool(snapshot.get("busy"))
        # A recovery in place reads its rows again: it must move too.
        ready = snapshot.get("state") in ("ready", "recovering")
        if self.stalled_at is None and ready and busy and last is not None:
            if now - last > self.deadline_s:
                self.stalled_at = now
        return self.stalled_at is not None

    def describe(self, snapshot: dict[str, Any], now: float | None = None) -> dict[str, Any]:
        now = time.time() if now is None else now
        last = self.last_progress(snapshot)
        return {
            "last_progress_at": last,
            "progress_age_s": None if last is None else round(now - last, 3),
            "progress_deadline_s": self.deadline_s,
            "stalled": self.stalled_at is not None,
        }

    def message(self) -> str:
        return (
            f"the engine made no progress for over {self.deadline_s:g}s; "
            "retry later (the watchdog restarts a wedged daemon)"
        )
