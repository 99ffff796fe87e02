"""One sample: swap and pressure from the platform probe, the daemon's own view from `status`.

The daemon is reached through the ordinary client library with a short timeout; the watchdog
never imports the daemon's engine. The process it may have to signal is identified by pid and
start time together, so a recycled pid is never signalled.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from moed.client import Client
from moed.client.errors import ClientError, DaemonRestarted
from moed.daemon.platform import MemoryProbe
from moed.daemon.watchdog.policy import DaemonReading, Sample


@dataclass(frozen=True)
class Target:
    pid: int
    create_time: float | None  # None: the process was already gone when first seen

    @classmethod
    def of(cls, pid: int) -> Target:
        try:
            return cls(pid, psutil.Process(pid).create_time())
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            return cls(pid, None)
        except psutil.AccessDenied:
            return cls(pid, None)

    def alive(self) -> bool:
        try:
            proc = psutil.Process(self.pid)
            if proc.status() == psutil.STATUS_ZOMBIE:
                return False
            return self.create_time is None or abs(proc.create_time() - self.create_time) < 0.01
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            return False
        except psutil.AccessDenied:
            return True


class DaemonLink:
    """The control channel: `status`, `shed`, `shutdown` through moed.client.Client."""

    def __init__(
        self,
        socket_path: Path,
        timeout_s: float = 1.0,
        client_factory: Callable[..., Any] | None = None,
    ):
        self.socket_path = socket_path
        self.timeout_s = timeout_s
        self._factory = client_factory
        self._client: Any = None

    def _connect(self) -> Any:
        if self._client is None:
            if self._factory is None:
                self._factory = Client
            self._client = self._factory(
                self.socket_path, timeout=self.timeout_s, name="moed.watchdog"
            )
        return self._client

    def _drop(self) -> None:
        if self._client is not None:
            try:
                self._client.close()
            except Exception:
                pass
            self._client = None

    def call(self, method: str, *args: Any, **kwargs: Any) -> dict:
        """Call a control method; a restarted daemon is re-handshaken once, a silent one raises."""
        for attempt in (1, 2):
            try:
                return getattr(self._connect(), method)(*args, **kwargs)
            except DaemonRestarted:
                self._drop()  # the new daemon is the one to talk to now
                if attempt == 2:
                    raise
            except ClientError:
                self._drop()  # a timed-out DEALER may hold stale replies; start clean
                raise
        raise AssertionError("unreachable")

    def status(self) -> dict | None:
        try:
            return self.call("status")
        except ClientError:
            return None

    def close(self) -> None:
        self._drop()


class Sampler:
    def __init__(
        self,
        probe: MemoryProbe,
        link: DaemonLink,
        pid_override: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ):
        self.probe = probe
        self.link = link
        self.pid_override = pid_override
        self.target: Target | None = Target.of(pid_override) if pid_override else None
        self.clock = clock
        self.wall = wall

    def sample(self) -> Sample:
        status = self.link.status()
        if status is not None:
            pid = self.pid_override or _int(status.get("pid"))
            if pid is not None and (self.target is None or self.target.pid != pid):
                self.target = Target.of(pid)
            alive = self.target.alive() if self.target else False
            daemon = DaemonReading(
                reachable=True,
                pid=pid,
                alive=alive,
                boot_id=status.get("boot_id"),
                busy=bool(status.get("busy")),
                active_requests=_int(status.get("active_requests")) or 0,
                last_token_at=_float(status.get("last_token_at")),
                last_progress_at=_float(status.get("last_progress_at")),
            )
        else:
            daemon = DaemonReading(
                reachable=False,
                pid=self.target.pid if self.target else None,
                alive=self.target.alive() if self.target else False,
            )
        footprint = (
            self.probe.process_footprint(daemon.pid) if daemon.pid and daemon.alive else None
        )
        return Sample(
            mono=self.clock(),
            wall=self.wall(),
            swap_used_bytes=self.probe.swap_used_bytes(),
            pressure=self.probe.pressure_level(),
            daemon=daemon,
            daemon_footprint_bytes=None
            if footprint is None
            else (footprint.phys_footprint_bytes or footprint.resident_bytes),
        )


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _float(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
