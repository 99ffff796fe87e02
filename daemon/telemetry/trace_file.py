"""A router trace written to the daemon's own `trace_dir`: advisory, so a failure drops the file
with a warning (a `telemetry` message with `warning`) and the generation goes on."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("moed.telemetry.trace")


class TraceFile:
    """A trace file that drops itself, with one warning to the client, when a write fails (a full
    disk): the trace is advisory, the generation goes on."""

    def __init__(self, path: Path, fd: int, warn: Callable[[str], None]):
        self.path = path
        self._f = os.fdopen(fd, "wb")
        self._warn = warn

    def write(self, data: bytes) -> None:
        if self._f is None:
            return
        try:
            self._f.write(data)
            self._f.flush()
        except OSError as exc:
            self._drop(f"trace file {self.path} dropped: {exc}")

    def _drop(self, message: str) -> None:
        log.warning(message)
        self._warn(message)
        f, self._f = self._f, None
        try:
            f.close()
        except OSError:
            pass
        try:
            self.path.unlink()
        except OSError:
            pass

    def close(self) -> None:
        if self._f is not None:
            try:
                self._f.close()
            except OSError as exc:
                self._f = None
                log.warning("trace file %s could not be closed: %s", self.path, exc)
            self._f = None


def open_trace_file(path: Path, warn: Callable[[str], None]) -> TraceFile | None:
    """A new trace file at `path`, or None (with a warning) when it cannot be created."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # A new file, never through a symlink: the trace directory may be shared.
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
        fd = os.open(path, flags, 0o600)
    except OSError as exc:
        message = f"trace not written: {path}: {exc}"
        log.warning(message)
        warn(message)
        return None
    log.info("tracing to %s", path)
    return TraceFile(path, fd, warn)
