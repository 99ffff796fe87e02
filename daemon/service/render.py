"""Render the service templates (launchd/ plists, units/ systemd units) with this environment's
absolute paths.

The templates hold the policy (restart rules, throttling, no core dumps); rendering fills in where
things are (interpreter, config file, log directory) and the stop timeout derived from the config.
Pure functions of a ServiceContext, so both platforms render and test on Linux.
"""

from __future__ import annotations

import enum
import math
import os
import plistlib
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path

from moed.daemon.config import Config
from moed.daemon.ground.exit_codes import PERMANENT_EXITS

# launchd sends SIGKILL this long after SIGTERM if the drain has not finished.
STOP_MARGIN_S = 15
WATCHDOG_STOP_S = 10


class ServiceManager(str, enum.Enum):
    """The service manager that runs moed: launchd LaunchAgents or systemd user units. The values
    are what `moed service --platform` takes."""

    LAUNCHD = "macos"
    SYSTEMD = "linux"

    @classmethod
    def of_host(cls) -> ServiceManager:
        return cls.LAUNCHD if sys.platform == "darwin" else cls.SYSTEMD


class Role(str, enum.Enum):
    DAEMON = "daemon"
    WATCHDOG = "watchdog"
    GATEWAY = "gateway"  # the HTTP gateway, installed only with `moed service install --gateway`

    @property
    def label(self) -> str:  # launchd Label and plist file stem
        return f"com.moed.{self.value}"

    @property
    def unit(self) -> str:  # systemd unit name
        return "moed.service" if self is Role.DAEMON else f"moed-{self.value}.service"

    @property
    def command(self) -> str:  # the `moed` subcommand the process runs
        return "serve" if self is Role.DAEMON else self.value

    @property
    def log_name(self) -> str:
        return f"{self.value}.log"


# Start the daemon before its watchdog (and the gateway, when installed); stop in reverse order.
START_ORDER = (Role.DAEMON, Role.WATCHDOG)
STOP_ORDER = (Role.WATCHDOG, Role.DAEMON)
GATEWAY_PORT = 11435


@dataclass(frozen=True)
class ServiceLayout:
    """Where a service manager keeps the service definitions, and where the config file goes."""

    manager: ServiceManager
    home: Path
    config_file: Path
    unit_dir: Path  # ~/Library/LaunchAgents or ~/.config/systemd/user

    def unit_path(self, role: Role) -> Path:
        return self.unit_dir / template_name(self.manager, role)


def layout_for(
    manager: ServiceManager,
    environ: Mapping[str, str] | None = None,
    config_file: Path | None = None,
) -> ServiceLayout:
    """The standard per-user locations for a platform, from HOME and XDG_* like moed.protocol.paths.

    Computed here because a dry run may target the other platform; on the host platform the config
    file agrees with moed.protocol.paths.config_path() (a test checks it).
    """
    env = os.environ if environ is None else environ
    home = Path(env.get("HOME") or Path.home())
    if manager is ServiceManager.LAUNCHD:
        default_config = home / "Library" / "Application Support" / "moed" / "config.toml"
        unit_dir = home / "Library" / "LaunchAgents"
    else:
        config_home = Path(env.get("XDG_CONFIG_HOME") or home / ".config")
        default_config = config_home / "moed" / "config.toml"
        unit_dir = config_home / "systemd" / "user"
    if config_file is None:
        config_file = Path(env["MOED_CONFIG"]) if env.get("MOED_CONFIG") else default_config
    return ServiceLayout(manager, home, config_file.expanduser().absolute(), unit_dir)


def foreign_defaults(
    manager: ServiceManager, environ: Mapping[str, str] | None = None
) -> dict[str, Path]:
    """Serve settings whose defaults differ by platform, for rendering the other platform's files.

    On the host these come from moed.protocol.paths; a dry run for the other platform uses these so
    that what it prints is what an install there would write.
    """
    env = os.environ if environ is None else environ
    home = Path(env.get("HOME") or Path.home())
    uid = os.getuid()
    if manager is ServiceManager.LAUNCHD:
        state = home / "Library" / "Application Support" / "moed"
        logs = home / "Library" / "Logs" / "moed"
        runtime = Path("/tmp") / f"moed-{uid}"
    else:
        state = Path(env.get("XDG_STATE_HOME") or home / ".local" / "state") / "moed"
        logs = state / "logs"
        runtime = Path(env.get("XDG_RUNTIME_DIR") or "/tmp") / f"moed-{uid}"
    values = {"state_dir": state, "log_dir": logs, "socket": runtime / "moed.sock"}
    # Explicit settings win on every platform, as in moed.protocol.paths.
    for name, var in (
        ("state_dir", "MOED_STATE_DIR"),
        ("log_dir", "MOED_LOG_DIR"),
        ("socket", "MOED_SOCKET"),
    ):
        if env.get(var):
            values[name] = Path(env[var])
    return values


@dataclass(frozen=True)
class ServiceContext:
    layout: ServiceLayout
    config: Config
    python: Path  # the interpreter of the installed environment, absolute
    uid: int
    gateway_port: int | None = None  # the HTTP gateway runs too, on this loopback port
    daemon: bool = True  # False on a pipeline's other hosts: the watchdog guards the rank there

    @property
    def roles(self) -> tuple[Role, ...]:
        """The processes of this installation, in start order."""
        roles = START_ORDER if self.daemon else (Role.WATCHDOG,)
        return roles + ((Role.GATEWAY,) if self.gateway_port else ())

    @property
    def stop_order(self) -> tuple[Role, ...]:
        return tuple(reversed(self.roles))

    @property
    def manager(self) -> ServiceManager:
        return self.layout.manager

    @property
    def log_dir(self) -> Path:
        # The daemon writes its own log where its config says; launchd's stdout/stderr go beside it.
        return Path(self.config.serve.log_dir)

    def log_path(self, role: Role) -> Path:
        return self.log_dir / role.log_name


def make_context(
    layout: ServiceLayout,
    config: Config,
    python: str | Path | None = None,
    uid: int | None = None,
    gateway_port: int | None = None,
    daemon: bool = True,
) -> ServiceContext:
    # Keep a venv's bin/python symlink as it is: resolving it would escape the venv.
    py = Path(python or sys.executable).absolute()
    uid = os.getuid() if uid is None else uid
    return ServiceContext(layout, config, py, uid, gateway_port, daemon)


def program_arguments(ctx: ServiceContext, role: Role) -> list[str]:
    base = [str(ctx.python), "-m", "moed.daemon.cli", role.command]
    if role is Role.GATEWAY:
        # A client of the daemon's socket; loopback only (an API key needs a hand-made unit).
        port = str(ctx.gateway_port or GATEWAY_PORT)
        return [*base, "--socket", str(ctx.config.serve.socket), "--port", port]
    return [*base, "--config", str(ctx.layout.config_file)]


def stop_timeout_s(ctx: ServiceContext, role: Role) -> int:
    if role is not Role.DAEMON:
        return WATCHDOG_STOP_S
    return int(math.ceil(ctx.config.serve.drain_timeout_s)) + STOP_MARGIN_S


def template_name(manager: ServiceManager, role: Role) -> str:
    return f"{role.label}.plist" if manager is ServiceManager.LAUNCHD else role.unit


def template_file(manager: ServiceManager, role: Role) -> Traversable:
    """The shipped template: plists in launchd/ (moed.launchd), units in units/ beside this file."""
    if manager is ServiceManager.LAUNCHD:
        folder = resources.files("moed.launchd")
    else:
        folder = resources.files("moed.daemon.service") / "units"
    return folder / template_name(manager, role)


def _placeholders(ctx: ServiceContext, role: Role) -> dict[str, str]:
    return {
        "@LABEL@": role.label,
        "@PYTHON@": str(ctx.python),
        "@CONFIG@": str(ctx.layout.config_file),
        "@LOG_DIR@": str(ctx.log_dir),
        "@SOCKET@": str(ctx.config.serve.socket),
        "@PORT@": str(ctx.gateway_port or GATEWAY_PORT),
    }


def _substitute(value, mapping: dict[str, str]):
    if isinstance(value, str):
        for key, text in mapping.items():
            value = value.replace(key, text)
        return value
    if isinstance(value, list):
        return [_substitute(v, mapping) for v in value]
    if isinstance(value, dict):
        return {k: _substitute(v, mapping) for k, v in value.items()}
    return value


def plist_dict(ctx: ServiceContext, role: Role) -> dict:
    template = template_file(ServiceManager.LAUNCHD, role).read_bytes()
    # Substituting parsed values (not raw XML) keeps paths with '&' or '<' well-formed.
    job = _substitute(plistlib.loads(template), _placeholders(ctx, role))
    job["ExitTimeOut"] = stop_timeout_s(ctx, role)
    return job


def render_plist(ctx: ServiceContext, role: Role) -> bytes:
    return plistlib.dumps(plist_dict(ctx, role), fmt=plistlib.FMT_XML, sort_keys=False)


def systemd_quote(arg: str) -> str:
    """Quote one ExecStart/Environment word: '%' is a specifier and '$' an expansion in units."""
    text = arg.replace("%", "%%").replace("$", "$$")
    if text and not any(c in text for c in " \t\"'\\;"):
        return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def render_unit(ctx: ServiceContext, role: Role) -> str:
    template = template_file(ServiceManager.SYSTEMD, role).read_text()
    serve = ctx.config.serve
    mapping = {
        "@EXEC_START@": " ".join(systemd_quote(a) for a in program_arguments(ctx, role)),
        "@ENV_CONFIG@": systemd_quote(f"MOED_CONFIG={ctx.layout.config_file}"),
        "@TIMEOUT_STOP@": f"{stop_timeout_s(ctx, role)}s",
        "@START_LIMIT_BURST@": str(serve.restart_budget),
        "@START_LIMIT_INTERVAL@": f"{int(math.ceil(serve.restart_window_s))}s",
        "@RESTART_PREVENT@": " ".join(str(int(code)) for code in PERMANENT_EXITS),
    }
    # Comment lines about the template itself are for readers of units/, not of the unit.
    lines = [
        line for line in template.splitlines(keepends=True) if not line.startswith("# Template:")
    ]
    text = "".join(lines)
    for key, value in mapping.items():
        text = text.replace(key, value)
    return text


def render(ctx: ServiceContext, role: Role) -> bytes:
    if ctx.manager is ServiceManager.LAUNCHD:
        return render_plist(ctx, role)
    return render_unit(ctx, role).encode()
