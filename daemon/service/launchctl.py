"""macOS: the launchctl command lines for a per-user agent and a parser of `launchctl print`.

Everything here is text in, text out, so it is tested on Linux against recorded real output.
Commands use the modern domain-target forms (bootstrap/bootout/kickstart/print in gui/<uid>),
not the deprecated load/unload.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

LAUNCHCTL = "launchctl"

# `launchctl print` of a label that is not loaded exits with this (ESRCH-like "not found").
EXIT_NOT_FOUND = 113


def domain(uid: int) -> str:
    return f"gui/{uid}"


def service_target(uid: int, label: str) -> str:
    return f"gui/{uid}/{label}"


def bootstrap(uid: int, plist: Path) -> list[str]:
    return [LAUNCHCTL, "bootstrap", domain(uid), str(plist)]


def bootout(uid: int, label: str) -> list[str]:
    return [LAUNCHCTL, "bootout", service_target(uid, label)]


def enable(uid: int, label: str) -> list[str]:
    # A label once `launchctl disable`d refuses to bootstrap until it is enabled again.
    return [LAUNCHCTL, "enable", service_target(uid, label)]


def kickstart(uid: int, label: str, kill: bool = False) -> list[str]:
    return [LAUNCHCTL, "kickstart", *(["-k"] if kill else []), service_target(uid, label)]


def print_(uid: int, label: str) -> list[str]:
    return [LAUNCHCTL, "print", service_target(uid, label)]


@dataclass(frozen=True)
class LaunchdState:
    """The facts of one job that `launchctl print` reports at the top level of its block."""

    loaded: bool
    state: str | None = None  # "running", "not running", "spawn scheduled", "xpcproxy", ...
    pid: int | None = None
    runs: int | None = None
    last_exit_code: int | None = None  # None: never exited, or ended by a signal
    last_exit_text: str | None = (
        None  # the value as printed: "1", "78: EX_CONFIG", "(never exited)"
    )
    last_signal: str | None = None  # "Abort trap: 6": replaces the exit code line after a crash
    last_exit_reason: str | None = None  # printed by some macOS versions (e.g. jetsam kills)
    program: str | None = None
    arguments: tuple[str, ...] = ()
    path: str | None = None
    spawn_type: str | None = None  # "interactive (4)" for ProcessType Interactive
    exit_timeout: int | None = None
    minimum_runtime: int | None = None  # ThrottleInterval

    @property
    def running(self) -> bool:
        return self.pid is not None or self.state == "running"

    @property
    def signal_number(self) -> int | None:
        if self.last_signal and (m := re.search(r":\s*(\d+)\s*$", self.last_signal)):
            return int(m.group(1))
        return None

    def last_exit(self) -> str | None:
        """One phrase for humans: 'exited 0', 'exited 78 (EX_CONFIG)', 'killed by Abort trap: 6'."""
        if self.last_signal:
            return f"killed by {self.last_signal}"
        if self.last_exit_code is not None:
            rest = (
                self.last_exit_text.split(":", 1)[1].strip()
                if self.last_exit_text and ":" in self.last_exit_text
                else ""
            )
            text = f"exited {self.last_exit_code}" + (f" ({rest})" if rest else "")
            return text + (f", {self.last_exit_reason}" if self.last_exit_reason else "")
        if self.last_exit_reason:
            return self.last_exit_reason
        if self.last_exit_text:
            return self.last_exit_text.strip("()")  # "never exited"
        return None


_TOP_LEVEL = re.compile(r"^\t(?P<key>[^\t=][^=]*?) = (?P<value>.*)$")


def parse_print(text: str) -> LaunchdState:
    """Parse `launchctl print gui/<uid>/<label>` output of a loaded job.

    Only the job's own level (one tab deep) is read: nested blocks (environment, coalitions,
    endpoints) repeat keys such as `state` and `active count` with other meanings.
    """
    fields: dict[str, str] = {}
    arguments: list[str] = []
    block: str | None = None
    for line in text.splitlines():
        if block is not None:
            if line.strip() == "}":
                block = None
            elif block == "arguments" and line.startswith("\t\t"):
                arguments.append(line.strip())
            continue
        m = _TOP_LEVEL.match(line)
        if not m:
            continue
        key, value = m.group("key").strip(), m.group("value").strip()
        if value == "{":
            block = key
            continue
        fields.setdefault(key, value)

    exit_text = fields.get("last exit code")
    exit_code = None
    if exit_text is not None and (m := re.match(r"^(-?\d+)", exit_text)):
        exit_code = int(m.group(1))
    signal = fields.get("last terminating signal")
    return LaunchdState(
        loaded=True,
        state=fields.get("state"),
        pid=_int(fields.get("pid")),
        runs=_int(fields.get("runs")),
        last_exit_code=exit_code,
        last_exit_text=exit_text,
        last_signal=signal,
        last_exit_reason=fields.get("last exit reason"),
        program=fields.get("program"),
        arguments=tuple(arguments),
        path=fields.get("path"),
        spawn_type=fields.get("spawn type"),
        exit_timeout=_int(fields.get("exit timeout")),
        minimum_runtime=_int(fields.get("minimum runtime")),
    )


def state_from_result(returncode: int, stdout: str, stderr: str) -> LaunchdState:
    """Interpret a finished `launchctl print`: not loaded is a state, not an error."""
    if returncode == 0:
        return parse_print(stdout)
    if returncode == EXIT_NOT_FOUND or "Could not find service" in (stderr + stdout):
        return LaunchdState(loaded=False)
    raise LaunchctlError(returncode, stderr or stdout)


class LaunchctlError(RuntimeError):
    def __init__(self, returncode: int, message: str):
        super().__init__(f"launchctl failed ({returncode}): {message.strip()}")
        self.returncode = returncode


def previous_exit(environ: dict[str, str] | None = None, run=None) -> str | None:
    """How this job's previous instance ended, asked from inside a launchd job; None elsewhere.

    launchd sets XPC_SERVICE_NAME to the job's label, and `print` on a running job still shows the
    previous run's end ("last terminating signal = Abort trap: 6" after a Metal abort).
    """
    import os
    import subprocess
    import sys

    env = os.environ if environ is None else environ
    label = env.get("XPC_SERVICE_NAME")
    if not label or label == "0" or (run is None and sys.platform != "darwin"):
        return None
    run = run or (lambda argv: subprocess.run(argv, capture_output=True, text=True, timeout=5))
    try:
        result = run(print_(os.getuid(), label))
        state = state_from_result(result.returncode, result.stdout, result.stderr)
    except Exception:  # advisory: never let this stop a start
        return None
    if not state.loaded or state.runs is None or state.runs <= 1:
        return None  # the first run since load has no previous end
    text = state.last_exit()
    return None if text in (None, "never exited") else text


def _int(value: str | None) -> int | None:
    if value is None:
        return None
    m = re.match(r"^(-?\d+)", value)
    return int(m.group(1)) if m else None
