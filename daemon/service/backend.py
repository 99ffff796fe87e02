"""One interface over launchd and systemd --user: install, uninstall, start, stop, restart, status,
logs.

Every side effect goes through an Executor (executor.py), which performs it or, in a dry run,
prints it (files as shell here-documents, commands as shell lines), so a dry run shows exactly what
a real run would do on either platform.
"""

from __future__ import annotations

import abc
import shlex
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from moed.daemon.ground.exit_codes import DaemonExit
from moed.daemon.service import launchctl, systemd
from moed.daemon.service.executor import CommandFailed, Executor, Result
from moed.daemon.service.render import (
    Role,
    ServiceContext,
    ServiceManager,
    render,
)


@dataclass(frozen=True)
class RoleStatus:
    role: Role
    name: str  # launchd label or systemd unit
    installed: bool  # its definition file is on disk
    loaded: bool
    running: bool
    pid: int | None = None
    state: str | None = None
    last_exit: str | None = None
    runs: int | None = None  # launchd: spawns since loaded
    restarts: int | None = None  # systemd: automatic restarts
    error: str | None = None  # the service manager could not be asked

    def as_dict(self) -> dict:
        d = asdict(self)
        d["role"] = self.role.value
        return d


class ServiceBackend(abc.ABC):
    manager: ServiceManager

    def __init__(self, ctx: ServiceContext, ex: Executor):
        self.ctx = ctx
        self.ex = ex

    # The definition files this backend installs, rendered for this environment.
    def files(self) -> dict[Path, bytes]:
        return {self.ctx.layout.unit_path(role): render(self.ctx, role) for role in self.ctx.roles}

    def install(self, config_text: str) -> list[str]:
        """Write the config (first install only), the logs directory and the units; load and start.

        Returns notes for the user.
        """
        notes = []
        config_file = self.ctx.layout.config_file
        if config_file.exists():
            notes.append(f"kept the existing config {config_file}")
        else:
            self.ex.write(config_file, config_text.encode(), mode=0o600)
        # launchd does not create the directory of StandardOutPath; the job would fail to spawn.
        self.ex.mkdir(self.ctx.log_dir)
        for path, content in self.files().items():
            self.ex.write(path, content)
        self._activate()
        return notes

    def uninstall(self, remove_config: bool, purge: bool = False) -> list[str]:
        """Stop and unload both processes and remove what install wrote.

        The config file goes when remove_config (the caller knows it is unedited) or purge; the logs
        only with purge.
        """
        notes = []
        self._deactivate()
        for path in self.files():
            self.ex.remove(path)
        self._after_remove()
        config_file = self.ctx.layout.config_file
        if config_file.exists():
            if purge or remove_config:
                self.ex.remove(config_file)
                self.ex.rmdir_if_empty(config_file.parent)
            else:
                notes.append(
                    f"kept your config {config_file} (edited since install; --purge removes it)"
                )
        log_dir = self.ctx.log_dir
        if purge:
            for role in self.ctx.roles:
                for path in _generations(self.ctx.log_path(role)):
                    self.ex.remove(path)
        elif log_dir.is_dir() and any(log_dir.iterdir()):
            notes.append(f"kept the logs in {log_dir} (--purge removes them)")
        self.ex.rmdir_if_empty(log_dir)
        return notes

    @abc.abstractmethod
    def _activate(self) -> None: ...

    @abc.abstractmethod
    def _deactivate(self) -> None: ...

    def _after_remove(self) -> None:  # noqa: B027 - an optional hook: most backends need nothing here
        """After the definition files are gone (systemd reloads its view of them)."""

    @abc.abstractmethod
    def start(self) -> None: ...

    @abc.abstractmethod
    def stop(self) -> None: ...

    @abc.abstractmethod
    def restart(self) -> None: ...

    def status(self) -> list[RoleStatus] | None:
        """None in a dry run (the queries were printed, nothing was asked)."""
        out: list[RoleStatus] = []
        for role in self.ctx.roles:
            result = self.ex.query(self._status_query(role))
            if result is not None:
                installed = self.ctx.layout.unit_path(role).exists()
                out.append(self._role_status(role, installed, result))
        return None if self.ex.dry_run else out

    @abc.abstractmethod
    def _status_query(self, role: Role) -> list[str]: ...

    @abc.abstractmethod
    def _role_status(self, role: Role, installed: bool, result: Result) -> RoleStatus:
        """The service manager's answer about one role (with `error` set when unreadable)."""

    @abc.abstractmethod
    def logs_commands(self, lines: int, follow: bool) -> list[list[str]]: ...

    def logs(self, lines: int = 200, follow: bool = False) -> int:
        commands = self.logs_commands(lines, follow)
        if follow:  # every follower at once: their lines interleave as they come
            return self.ex.foreground_all(commands)
        return max(self.ex.foreground(argv) for argv in commands)


def tail_command(paths: list[Path], lines: int, follow: bool) -> list[str]:
    # -F follows across rotation (the daemon renames its log when it grows too large).
    return ["tail", "-n", str(lines), *(["-F"] if follow else []), *map(str, paths)]


def _generations(path: Path, keep: int = 9) -> list[Path]:
    return [path] + [
        path.with_name(f"{path.name}.{i}")
        for i in range(1, keep + 1)
        if path.with_name(f"{path.name}.{i}").exists()
    ]


class LaunchdBackend(ServiceBackend):
    """Per-user LaunchAgents in gui/<uid>.

    stop unloads the jobs (bootout), so that KeepAlive does not bring them back; their plists stay
    in ~/Library/LaunchAgents, so they come back at the next login or with start.
    """

    manager = ServiceManager.LAUNCHD
    # Retried bootstrap failures: the previous instance is still being torn down (5: I/O error,
    # 37: operation already in progress).
    BUSY = frozenset({5, 37})

    @property
    def uid(self) -> int:
        return self.ctx.uid

    def _plist(self, role: Role) -> Path:
        return self.ctx.layout.unit_path(role)

    def _activate(self) -> None:
        for role in self.ctx.roles:
            # Reinstalling replaces a loaded job: unload the old definition first.
            self.ex.run(launchctl.bootout(self.uid, role.label), tolerate=True)
            self.ex.run(launchctl.enable(self.uid, role.label), tolerate=True)
            self._bootstrap(role, already_loaded_ok=False)

    def _bootstrap(self, role: Role, already_loaded_ok: bool) -> None:
        argv = launchctl.bootstrap(self.uid, self._plist(role))
        if self.ex.dry_run:
            self.ex.run(argv, tolerate=already_loaded_ok)
            return
        result = Result(0)
        for _ in range(10):
            result = self.ex.run(argv, tolerate=True)
            if result.returncode == 0:
                return
            # bootstrap of a loaded job fails (5 on most versions): for start that is success.
            if already_loaded_ok and self._loaded(role):
                return
            if result.returncode not in self.BUSY:
                break
            time.sleep(0.5)  # the previous instance may still be booting out
        # launchd says "5: Input/output error" for a malformed plist too.
        raise CommandFailed(
            argv,
            result,
            hint=(
                f"check the plist with: plutil -lint {shlex.quote(str(self._plist(role)))}\n"
                f"gui/{self.uid} exists only while you are logged in at the Mac's screen "
                "(not over ssh alone)"
            ),
        )

    def _loaded(self, role: Role) -> bool:
        result = self.ex.query(launchctl.print_(self.uid, role.label))
        return result is not None and result.returncode == 0

    def _deactivate(self) -> None:
        for role in self.ctx.stop_order:
            # bootout waits for the SIGTERM → ExitTimeOut → SIGKILL sequence; not loaded is fine.
            self.ex.run(launchctl.bootout(self.uid, role.label), tolerate=True)

    def start(self) -> None:
        for role in self.ctx.roles:
            self._bootstrap(role, already_loaded_ok=True)
            self.ex.run(launchctl.kickstart(self.uid, role.label))

    def stop(self) -> None:
        self._deactivate()

    def restart(self) -> None:
        for role in self.ctx.roles:
            self.ex.run(
                launchctl.kickstart(self.uid, role.label, kill=True),
                hint="not loaded? run: moed service start",
            )

    def _status_query(self, role: Role) -> list[str]:
        return launchctl.print_(self.uid, role.label)

    def _role_status(self, role: Role, installed: bool, result: Result) -> RoleStatus:
        try:
            st = launchctl.state_from_result(result.returncode, result.stdout, result.stderr)
        except launchctl.LaunchctlError as exc:
            return RoleStatus(role, role.label, installed, False, False, error=str(exc))
        code = st.last_exit_code if ":" not in (st.last_exit_text or "") else None
        last = _name_exit(role, st.last_exit(), code)
        return RoleStatus(
            role, role.label, installed, st.loaded, st.running, st.pid, st.state, last, runs=st.runs
        )

    def logs_commands(self, lines: int, follow: bool) -> list[list[str]]:
        # Every process's stderr is its log file here.
        return [tail_command([self.ctx.log_path(r) for r in self.ctx.roles], lines, follow)]


class SystemdBackend(ServiceBackend):
    """systemd --user units; stop/start keep them enabled for the next login."""

    manager = ServiceManager.SYSTEMD
    HINT = (
        "is systemd --user running for this user? (a login session, or `loginctl enable-linger`; "
        "XDG_RUNTIME_DIR must point at it)"
    )

    @property
    def units(self) -> list[str]:
        return [role.unit for role in self.ctx.roles]

    def _activate(self) -> None:
        self.ex.run(systemd.daemon_reload(), hint=self.HINT)
        self.ex.run(systemd.enable_now(self.units), hint=self.HINT)

    def _deactivate(self) -> None:
        # Not loaded (never installed, or the user manager is gone) must not block removal.
        self.ex.run(systemd.disable_now(self.units), tolerate=True)

    def _after_remove(self) -> None:
        self.ex.run(systemd.daemon_reload(), tolerate=True)
        self.ex.run(systemd.reset_failed(self.units), tolerate=True)

    def start(self) -> None:
        self.ex.run(systemd.verb("start", self.units), hint=self.HINT)

    def stop(self) -> None:
        # systemd stops the watchdog first: it is ordered After= the daemon.
        self.ex.run(systemd.verb("stop", self.units), hint=self.HINT)

    def restart(self) -> None:
        self.ex.run(systemd.verb("restart", self.units), hint=self.HINT)

    def _status_query(self, role: Role) -> list[str]:
        return systemd.show(role.unit)

    def _role_status(self, role: Role, installed: bool, result: Result) -> RoleStatus:
        try:
            st = systemd.state_from_result(result.returncode, result.stdout, result.stderr)
        except systemd.SystemctlError as exc:
            return RoleStatus(role, role.unit, installed, False, False, error=str(exc))
        code = st.exec_main_status if st.exec_main_code == 1 else None
        last = _name_exit(role, st.last_exit(), code)
        return RoleStatus(
            role,
            role.unit,
            installed,
            st.loaded,
            st.running,
            st.pid,
            st.state,
            last,
            restarts=st.restarts,
        )

    def logs_commands(self, lines: int, follow: bool) -> list[list[str]]:
        # daemon.log has all of the daemon's story (start and exit records, every log line); the
        # other processes log to the journal only.
        others = [role.unit for role in self.ctx.roles if role is not Role.DAEMON]
        commands = []
        if Role.DAEMON in self.ctx.roles:
            commands.append(tail_command([self.ctx.log_path(Role.DAEMON)], lines, follow))
        if others:
            commands.append(systemd.journal(others, lines, follow))
        return commands


def _name_exit(role: Role, text: str | None, code: int | None) -> str | None:
    """Add the daemon's own name for its exit code: 'exited 3' -> 'exited 3 [MODEL_NOT_FOUND]'."""
    if text is None or code is None or code == 0 or role is not Role.DAEMON:
        return text
    try:
        return f"{text} [{DaemonExit(code).name}]"
    except ValueError:
        return text


BACKENDS: dict[ServiceManager, type[ServiceBackend]] = {
    ServiceManager.LAUNCHD: LaunchdBackend,
    ServiceManager.SYSTEMD: SystemdBackend,
}
