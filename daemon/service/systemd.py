"""Linux: the `systemctl --user` / `journalctl --user` command lines and a parser of
`systemctl show`."""

from __future__ import annotations

from dataclasses import dataclass

SYSTEMCTL = "systemctl"
JOURNALCTL = "journalctl"

SHOW_PROPERTIES = (
    "LoadState",
    "ActiveState",
    "SubState",
    "UnitFileState",
    "MainPID",
    "ExecMainCode",
    "ExecMainStatus",
    "Result",
    "NRestarts",
)


def daemon_reload() -> list[str]:
    return [SYSTEMCTL, "--user", "daemon-reload"]


def enable_now(units: list[str]) -> list[str]:
    return [SYSTEMCTL, "--user", "enable", "--now", *units]


def disable_now(units: list[str]) -> list[str]:
    return [SYSTEMCTL, "--user", "disable", "--now", *units]


def verb(name: str, units: list[str]) -> list[str]:
    """start / stop / restart."""
    return [SYSTEMCTL, "--user", name, *units]


def reset_failed(units: list[str]) -> list[str]:
    return [SYSTEMCTL, "--user", "reset-failed", *units]


def show(unit: str) -> list[str]:
    return [SYSTEMCTL, "--user", "show", "-p", ",".join(SHOW_PROPERTIES), unit]


def journal(units: list[str], lines: int, follow: bool) -> list[str]:
    argv = [JOURNALCTL, "--user"]
    for unit in units:
        argv += ["-u", unit]
    argv += ["-n", str(lines), "--no-pager"]
    if follow:
        argv.append("-f")
    return argv


# ExecMainCode holds the siginfo si_code of the main process's end.
_CLD = {1: "exited", 2: "killed", 3: "dumped core"}


@dataclass(frozen=True)
class UnitState:
    loaded: bool
    active_state: str | None = None  # active, inactive, failed, activating, deactivating
    sub_state: str | None = None  # running, dead, auto-restart, ...
    enabled: str | None = None  # UnitFileState: enabled, disabled, ...
    pid: int | None = None
    exec_main_code: int | None = None
    exec_main_status: int | None = None
    result: str | None = None  # success, exit-code, signal, core-dump, timeout, start-limit-hit
    restarts: int | None = None

    @property
    def running(self) -> bool:
        return self.active_state == "active" and self.sub_state == "running"

    @property
    def state(self) -> str | None:
        if self.active_state is None:
            return None
        return f"{self.active_state} ({self.sub_state})" if self.sub_state else self.active_state

    def last_exit(self) -> str | None:
        if not self.exec_main_code:
            return None  # never exited since the unit was loaded
        how = _CLD.get(self.exec_main_code, f"code {self.exec_main_code}")
        if how == "exited":
            text = f"exited {self.exec_main_status}"
        else:
            text = f"{how} by signal {self.exec_main_status}"
        return text + (f" ({self.result})" if self.result and self.result != "success" else "")


def parse_show(text: str) -> UnitState:
    fields = dict(line.split("=", 1) for line in text.splitlines() if "=" in line)
    load = fields.get("LoadState")
    return UnitState(
        loaded=load == "loaded",
        active_state=fields.get("ActiveState") or None,
        sub_state=fields.get("SubState") or None,
        enabled=fields.get("UnitFileState") or None,
        pid=_int(fields.get("MainPID")) or None,  # 0 means no process
        exec_main_code=_int(fields.get("ExecMainCode")),
        exec_main_status=_int(fields.get("ExecMainStatus")),
        result=fields.get("Result") or None,
        restarts=_int(fields.get("NRestarts")),
    )


class SystemctlError(RuntimeError):
    def __init__(self, returncode: int, message: str):
        super().__init__(f"systemctl failed ({returncode}): {message.strip()}")
        self.returncode = returncode


def state_from_result(returncode: int, stdout: str, stderr: str) -> UnitState:
    if returncode == 0:
        return parse_show(stdout)
    raise SystemctlError(returncode, stderr or stdout)


def _int(value: str | None) -> int | None:
    try:
        return int(value) if value not in (None, "") else None
    except ValueError:
        return None
