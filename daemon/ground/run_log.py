"""Size-bounded log files that rotate, and the start record written at each daemon start.

Under launchd the daemon's stdout/stderr are the same file (StandardOutPath/StandardErrorPath), and
launchd never rotates it. RotatingLog renames the file when it grows past its bound and points
fds 1 and 2 at the fresh file when they were writing to the old one, so a stray traceback or a
Metal abort message lands in the current generation. Under systemd stdout goes to the journal and
the same file holds the daemon's own records.
"""

from __future__ import annotations

import datetime as _dt
import logging
import os
import re
import shlex
import sys
import threading
from pathlib import Path

from moed.daemon.ground.state_files import open_nofollow

DEFAULT_MAX_BYTES = 10 * 1024 * 1024
DEFAULT_BACKUPS = 3  # daemon.log, daemon.log.1 .. daemon.log.3
DAEMON_LOG = "daemon.log"


class RotatingLog:
    """Append lines to `path`; past max_bytes rename it to path.1 (path.1 → path.2, ...), keep
    `backups`."""

    def __init__(
        self,
        path: Path,
        max_bytes: int = DEFAULT_MAX_BYTES,
        backups: int = DEFAULT_BACKUPS,
        adopt_stdio: bool = True,
    ):
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.backups = max(0, backups)
        self.adopt_stdio = adopt_stdio
        self._lock = threading.Lock()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = self._open()
        # A file left over-size by the previous run starts this run in a fresh generation.
        if os.fstat(self._fd).st_size >= self.max_bytes:
            self.rotate()

    def _open(self) -> int:
        # Never through a symlink: another user must not point the daemon's log at a file of theirs.
        return open_nofollow(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)

    def write(self, line: str) -> None:
        data = (line if line.endswith("\n") else line + "\n").encode("utf-8", "replace")
        with self._lock:
            os.write(self._fd, data)
            if os.fstat(self._fd).st_size >= self.max_bytes:
                self._rotate_locked()

    def rotate(self) -> None:
        with self._lock:
            self._rotate_locked()

    def _rotate_locked(self) -> None:
        old = os.fstat(self._fd)
        stdio = [fd for fd in (1, 2) if self.adopt_stdio and _same_file(fd, old)]
        if self.backups == 0:
            os.truncate(self.path, 0)
            return
        for i in range(self.backups - 1, 0, -1):
            src = self.generation(i)
            if src.exists():
                os.replace(src, self.generation(i + 1))
        if self.path.exists():
            os.replace(self.path, self.generation(1))
        new_fd = self._open()
        os.close(self._fd)
        self._fd = new_fd
        for fd in stdio:
            os.dup2(new_fd, fd)

    def generation(self, i: int) -> Path:
        return self.path if i == 0 else self.path.with_name(f"{self.path.name}.{i}")

    def owns_stderr(self) -> bool:
        """True when fd 2 is this file (launchd's StandardErrorPath): stderr output is already
        here."""
        with self._lock:
            return self._fd >= 0 and _same_file(2, os.fstat(self._fd))

    def adopt_logging(
        self, logger: logging.Logger | None = None, level: int = logging.INFO
    ) -> logging.Handler:
        """Send `logger` (default: root) through this log, so it rotates on size.

        When stderr is this very file (under launchd), the logger's stderr handlers are removed:
        they would write every line twice.
        """
        logger = logger or logging.getLogger()
        if self.owns_stderr():
            for h in list(logger.handlers):
                if isinstance(h, logging.StreamHandler) and getattr(h, "stream", None) in (
                    sys.stderr,
                    sys.__stderr__,
                ):
                    logger.removeHandler(h)
        handler = self.handler(level)
        logger.addHandler(handler)
        return handler

    def record_exit(self, code: int, reason: str | None = None) -> None:
        """One line at the end of a run, the counterpart of the start record."""
        self.write(
            f"{_now()} moed exit code={int(code)} pid={os.getpid()} "
            f"reason={_value(reason or 'unknown')}"
        )

    def handler(
        self,
        level: int = logging.INFO,
        fmt: str = "%(asctime)s %(levelname)s %(name)s: %(message)s",
    ) -> logging.Handler:
        """A logging handler writing through this log (so it rotates on size)."""
        return _Handler(self, level, fmt)

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def __enter__(self) -> RotatingLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Handler(logging.Handler):
    def __init__(self, log: RotatingLog, level: int, fmt: str):
        super().__init__(level)
        self.log = log
        self.setFormatter(logging.Formatter(fmt))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.log.write(self.format(record))
        except Exception:
            self.handleError(record)


def _same_file(fd: int, st: os.stat_result) -> bool:
    try:
        other = os.fstat(fd)
    except OSError:
        return False
    return (other.st_dev, other.st_ino) == (st.st_dev, st.st_ino)


def _now() -> str:
    return _dt.datetime.now(_dt.UTC).astimezone().isoformat(timespec="seconds")


def _value(v: object) -> str:
    text = "" if v is None else str(v)
    return (
        text
        if text and re.fullmatch(r"[\w./:@%+,-]+", text)
        else '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
    )


def format_start(
    version: str, model: str, budget: object, previous_exit: str | None, pid: int | None = None
) -> str:
    fields = {
        "version": version,
        "pid": os.getpid() if pid is None else pid,
        "model": model,
        "budget": budget,
        "previous_exit": previous_exit if previous_exit else "unknown",
    }
    return f"{_now()} moed start " + " ".join(f"{k}={_value(v)}" for k, v in fields.items())


def record_start(
    log_dir: Path,
    version: str,
    model: str,
    budget: object,
    previous_exit: str | None,
    *,
    name: str = DAEMON_LOG,
    max_bytes: int = DEFAULT_MAX_BYTES,
    backups: int = DEFAULT_BACKUPS,
) -> RotatingLog:
    """Append one start record to <log_dir>/daemon.log (rotating it first if it is over size).

    Returns the open RotatingLog: keep it, attach `log.handler()` to logging, close it at exit.
    """
    log = RotatingLog(Path(log_dir) / name, max_bytes=max_bytes, backups=backups)
    log.write(format_start(version, model, budget, previous_exit))
    return log


_START = re.compile(r"^(?P<time>\S+) moed start (?P<rest>.*)$")
_EXIT = re.compile(r"^(?P<time>\S+) moed exit code=(?P<code>-?\d+) .*?reason=(?P<reason>\S*)")


def previous_run_end(path: Path) -> str | None:
    """How the last run recorded in this log ended, read before a new start record is added: its
    exit record, or that it never wrote one (killed or crashed); None when there is no log."""
    lines: list[str] = []
    for file in (path.with_name(f"{path.name}.1"), path):  # a rotation may split the two
        try:
            lines += file.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            continue
    started, ended = False, None
    for line in lines:
        if _START.match(line):
            started, ended = True, None
        elif m := _EXIT.match(line):
            ended = m
    if ended is not None:
        code, reason = int(ended.group("code")), ended.group("reason") or "unknown"
        kind = "clean exit" if code == 0 else f"exit code {code}"
        return f"{kind} ({reason}) at {ended.group('time')}"
    return "no exit record (killed or crashed)" if started else None


def read_start_records(path: Path, backups: int = DEFAULT_BACKUPS) -> list[dict[str, str]]:
    """Start records of a log and its rotated generations, oldest first."""
    records: list[dict[str, str]] = []
    files = [path.with_name(f"{path.name}.{i}") for i in range(backups, 0, -1)] + [path]
    for file in files:
        try:
            text = file.read_text(errors="replace")
        except FileNotFoundError:
            continue
        for line in text.splitlines():
            if m := _START.match(line):
                try:
                    words = shlex.split(m.group("rest"))
                except ValueError:
                    continue
                record = {"time": m.group("time")}
                record.update(w.split("=", 1) for w in words if "=" in w)
                records.append(record)
    return records
