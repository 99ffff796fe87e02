"""What `moe` and `moed` share on the command line: the global options and their resolution.

The global options (--socket, --state-dir, --log-dir) are accepted in the same place on both tools:
before the subcommand (`moe --socket S run`, `moed --socket S serve`) and, for convenience, after it
(`moed serve --socket S`); a value after the subcommand wins. Imports no mlx.
"""

from __future__ import annotations

import enum
import json
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import click

from moed.protocol import paths

from .errors import START_HINT, ClientError, DaemonNotRunning

_META_KEY = "moed.global_options"
CONTEXT_SETTINGS = {"help_option_names": ["-h", "--help"]}
F = TypeVar("F", bound=Callable[..., Any])  # a click command, decorated as it is


@dataclass(frozen=True)
class GlobalOptions:
    """The global options as given (None: not given, so the config file / environment decides)."""

    socket: Path | None = None
    state_dir: Path | None = None
    log_dir: Path | None = None

    @property
    def socket_path(self) -> Path:
        return self.socket or paths.default_socket_path()

    @property
    def state_path(self) -> Path:
        return self.state_dir or paths.state_dir()

    @property
    def log_path(self) -> Path:
        return self.log_dir or paths.log_dir()


def _remember(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    # Parsed in command-line order, so a value after the subcommand overwrites one before it.
    if value is not None:
        ctx.find_root().meta.setdefault(_META_KEY, {})[param.name] = value
    return value


def _global_params() -> list[click.Option]:
    path = click.Path(path_type=Path)
    return [
        click.Option(
            ["--socket"],
            type=path,
            expose_value=False,
            callback=_remember,
            help="Daemon ipc socket (default: $MOED_SOCKET or the per-user runtime dir). "
            "Global: before or after the subcommand.",
        ),
        click.Option(
            ["--state-dir"],
            type=path,
            expose_value=False,
            callback=_remember,
            help="State files: usage profile, crash record, backoff (default: $MOED_STATE_DIR "
            "or the per-user state dir). Global: before or after the subcommand.",
        ),
        click.Option(
            ["--log-dir"],
            type=path,
            expose_value=False,
            callback=_remember,
            help="Where daemon.log and watchdog.log go (default: $MOED_LOG_DIR or the per-user "
            "log dir). Global: before or after the subcommand.",
        ),
    ]


GLOBAL_OPTION_NAMES = ("socket", "state_dir", "log_dir")


def add_global_options(command: click.Command) -> click.Command:
    """Accept the global options on `command` and, recursively, on every subcommand."""
    have = {p.name for p in command.params}
    command.params.extend(p for p in _global_params() if p.name not in have)
    if isinstance(command, click.Group):
        for sub in command.commands.values():
            add_global_options(sub)
    return command


def global_options(ctx: click.Context | None = None) -> GlobalOptions:
    ctx = ctx or click.get_current_context()
    given = ctx.find_root().meta.get(_META_KEY, {})
    return GlobalOptions(**{k: given.get(k) for k in GLOBAL_OPTION_NAMES})


def json_line(obj: dict[str, Any]) -> None:
    """One JSON object on its own stdout line (the --json modes)."""
    click.echo(json.dumps(obj, default=str))


def unavailable(exc: ClientError) -> str:
    """A DaemonUnavailable's message; when none runs, with how to start one."""
    return f"{exc}; {START_HINT}" if isinstance(exc, DaemonNotRunning) else str(exc)


def fail(
    exit_code: int, message: str, as_json: bool = False, prog: str = "moe", **fields: Any
) -> NoReturn:
    """Exit with a typed error: a JSON `error` line in --json modes; the message on stderr."""
    if as_json:
        json_line({"type": "error", **fields, "message": message})
    click.echo(f"{prog}: {message}", err=True)
    sys.exit(exit_code)


class LogLevel(str, enum.Enum):
    DEBUG = "DEBUG"
    INFO = "INFO"
    WARNING = "WARNING"
    ERROR = "ERROR"


def log_level_option(command: F) -> F:
    """`--log-level` for the long-running processes (serve, watchdog, rank, gateway)."""
    return click.option(
        "--log-level",
        default=LogLevel.INFO.value,
        show_default=True,
        type=click.Choice([level.value for level in LogLevel], case_sensitive=False),
        help="Logging threshold.",
    )(command)


def log_to_stderr(level: str, tag: str = "") -> None:
    """Timestamped log lines on stderr (the service manager or the run log keeps them)."""
    logging.basicConfig(
        level=level.upper(),
        format=f"%(asctime)s %(levelname)s {tag}%(name)s: %(message)s",
        stream=sys.stderr,
    )
