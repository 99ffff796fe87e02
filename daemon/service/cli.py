"""`moed service install|uninstall|start|stop|restart|status|logs`: run moed under launchd or
systemd --user."""

from __future__ import annotations

import enum
import hashlib
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from moed.client import Client
from moed.client.cli_common import global_options
from moed.client.errors import DaemonUnavailable
from moed.daemon.config import ConfigError, load_config, to_toml
from moed.daemon.ground import run_log as service_logs
from moed.daemon.ground.exit_codes import ConfigExit
from moed.daemon.service.backend import BACKENDS, RoleStatus, ServiceBackend
from moed.daemon.service.executor import CommandFailed, Executor
from moed.daemon.service.render import (
    GATEWAY_PORT,
    Role,
    ServiceContext,
    ServiceManager,
    foreign_defaults,
    layout_for,
    make_context,
)
from moed.protocol.units import format_bytes, format_duration

DIGEST_PREFIX = "# sha256 of the settings below as written: "


class ExitCode(enum.IntEnum):
    OK = 0
    ERROR = 1
    NOT_RUNNING = 3  # as LSB `status`: the service is not (fully) running


def config_text(body: str) -> str:
    """The first config file: a header whose digest lets uninstall tell an untouched file."""
    digest = hashlib.sha256(body.encode()).hexdigest()
    return (
        "# moed configuration, written by `moed service install`. Edit freely, then\n"
        "# `moed service restart`. `moed service uninstall` removes this file only while it is "
        "unedited.\n"
        f"{DIGEST_PREFIX}{digest}\n\n{body}"
    )


def is_pristine(text: str) -> bool:
    head, sep, body = text.partition("\n\n")
    for line in head.splitlines():
        if line.startswith(DIGEST_PREFIX):
            return (
                sep != ""
                and hashlib.sha256(body.encode()).hexdigest() == line[len(DIGEST_PREFIX) :].strip()
            )
    return False


class _Session:
    """What every verb needs: the target platform, its config and the backend driving it."""

    def __init__(
        self,
        platform: str | None,
        config_file: Path | None,
        dry_run: bool,
        serve_overrides: dict[str, Any] | None = None,
        factory: Callable | None = None,
        gateway_port: int | None = None,
        watchdog_only: bool | None = None,
    ):
        self.manager = ServiceManager(platform) if platform else ServiceManager.of_host()
        environ = dict(os.environ)
        self.layout = layout_for(self.manager, environ, config_file)
        overrides = {k: v for k, v in (serve_overrides or {}).items() if v is not None}
        if self.manager is not ServiceManager.of_host():
            # A dry run for the other platform shows that platform's default locations.
            for key, value in foreign_defaults(self.manager, environ).items():
                overrides.setdefault(key, value)
        try:
            self.config = load_config(self.layout.config_file, environ, overrides)
        except ConfigError as exc:
            raise ConfigExit(exc) from None
        if gateway_port is None and self.layout.unit_path(Role.GATEWAY).exists():
            gateway_port = GATEWAY_PORT  # installed earlier: manage it with the others
        if watchdog_only is None:  # installed earlier on a pipeline's other host: no daemon unit
            watchdog_only = (
                self.layout.unit_path(Role.WATCHDOG).exists()
                and not self.layout.unit_path(Role.DAEMON).exists()
            )
        self.ctx: ServiceContext = make_context(
            self.layout, self.config, gateway_port=gateway_port, daemon=not watchdog_only
        )
        self.ex = Executor(dry_run=dry_run, echo=click.echo)
        self.backend: ServiceBackend = (factory or BACKENDS[self.manager])(self.ctx, self.ex)

    def first_config(self) -> str:
        return config_text(to_toml(self.config))


def _common(fn):
    fn = click.option(
        "--dry-run",
        is_flag=True,
        help="Print every file and command instead of writing or running it.",
    )(fn)
    fn = click.option(
        "--platform",
        type=click.Choice([m.value for m in ServiceManager]),
        default=None,
        help="Target launchd (macos) or systemd (linux); default: this machine's. For dry runs.",
    )(fn)
    fn = click.option(
        "--config",
        "config_file",
        type=click.Path(dir_okay=False, path_type=Path),
        default=None,
        help="Config file the service runs with (default: the per-user config path).",
    )(fn)
    return fn


def _session(
    platform, config_file, dry_run, serve_overrides=None, gateway_port=None, watchdog_only=None
) -> _Session:
    obj = click.get_current_context().find_object(dict) or {}
    given = global_options()
    overrides = {
        "socket": given.socket,
        "state_dir": given.state_dir,
        "log_dir": given.log_dir,
        **(serve_overrides or {}),
    }
    return _Session(
        platform,
        config_file,
        dry_run,
        overrides,
        obj.get("backend_factory"),
        gateway_port,
        watchdog_only,
    )


def _guard(action: Callable[[], Any]) -> Any:
    try:
        return action()
    except CommandFailed as exc:
        raise click.ClickException(str(exc)) from None


@click.group()
def service() -> None:
    """Run the daemon and its watchdog as a per-user service (launchd on macOS, systemd --user on
    Linux)."""


@service.command()
@_common
@click.option("--model", default=None, help="Model for a first install's config file.")
@click.option(
    "--cache-budget", default=None, help="Expert cache budget for a first install's config file."
)
@click.option(
    "--gateway",
    is_flag=True,
    help="Also run `moed gateway` (OpenAI/Ollama/Anthropic HTTP APIs on loopback) as a service.",
)
@click.option(
    "--gateway-port",
    type=int,
    default=GATEWAY_PORT,
    show_default=True,
    help="Loopback port of the gateway service.",
)
@click.option(
    "--pipeline",
    type=click.IntRange(min=2),
    default=None,
    help="Serve over N local ranks (the unit runs rank 0; it starts and stops the others).",
)
@click.option(
    "--hostfile",
    default=None,
    help="Serve over the hosts of an mlx.launch hostfile (rank 0 reaches the others by ssh).",
)
@click.option(
    "--watchdog-only",
    is_flag=True,
    help="Only the watchdog: for a pipeline's other hosts, where it guards this host's rank.",
)
def install(
    dry_run,
    platform,
    config_file,
    model,
    cache_budget,
    gateway,
    gateway_port,
    pipeline,
    hostfile,
    watchdog_only,
):
    """Write the config (first time only) and the service definitions; load and start the daemon
    and its watchdog (and the HTTP gateway with --gateway; only the watchdog with
    --watchdog-only)."""
    given = {"model": model, "cache_budget": cache_budget, "pipeline": pipeline}
    if watchdog_only and (gateway or hostfile or any(v is not None for v in given.values())):
        raise click.UsageError("--watchdog-only installs no daemon: it takes no serve options")
    if hostfile is not None:
        given["hostfile"] = str(Path(hostfile).expanduser().resolve())
    s = _session(
        platform, config_file, dry_run, given, gateway_port if gateway else None, watchdog_only
    )
    socket = global_options().socket
    if s.layout.config_file.exists() and any(v is not None for v in (*given.values(), socket)):
        click.echo(
            f"note: {s.layout.config_file} exists and is kept; edit it to change settings", err=True
        )
    notes = _guard(lambda: s.backend.install(s.first_config()))
    for note in notes:
        click.echo(f"note: {note}", err=True)
    if not dry_run:
        click.echo(f"installed {', '.join(str(p) for p in s.backend.files())}")
        if s.manager is ServiceManager.SYSTEMD:
            click.echo("to keep it running without a login session: loginctl enable-linger $USER")


@service.command()
@_common
@click.option("--purge", is_flag=True, help="Also remove the config file and the logs.")
def uninstall(dry_run, platform, config_file, purge):
    """Stop both processes and remove the service definitions (and an unedited config)."""
    s = _session(platform, config_file, dry_run)
    text = s.layout.config_file.read_text() if s.layout.config_file.exists() else ""
    for note in _guard(lambda: s.backend.uninstall(remove_config=is_pristine(text), purge=purge)):
        click.echo(f"note: {note}", err=True)


@service.command()
@_common
def start(dry_run, platform, config_file):
    """Load (if needed) and start the daemon and the watchdog."""
    s = _session(platform, config_file, dry_run)
    _guard(s.backend.start)


@service.command()
@_common
def stop(dry_run, platform, config_file):
    """Stop both processes gracefully (they come back at the next login, or with start)."""
    s = _session(platform, config_file, dry_run)
    _guard(s.backend.stop)


@service.command()
@_common
def restart(dry_run, platform, config_file):
    """Restart both processes (the daemon drains first); picks up config edits."""
    s = _session(platform, config_file, dry_run)
    _guard(s.backend.restart)


@service.command()
@_common
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option(
    "--timeout", default=2.0, show_default=True, help="Seconds to wait for the daemon's own answer."
)
def status(dry_run, platform, config_file, as_json, timeout):
    """Loaded/running/pid/last exit of both processes, and the daemon's own status when it
    answers."""
    s = _session(platform, config_file, dry_run)
    roles = _guard(s.backend.status)
    socket = Path(s.config.serve.socket)
    if roles is None:  # dry run: the queries were printed
        click.echo(f"# then ask the daemon for its status on {socket}")
        return
    answer, why = daemon_status(socket, timeout)
    starts = service_logs.read_start_records(s.ctx.log_path(Role.DAEMON))
    report = {
        "platform": s.manager.value,
        "config": str(s.layout.config_file),
        "socket": str(socket),
        "services": [r.as_dict() for r in roles],
        "daemon": answer,
        "daemon_error": why,
        "last_start": starts[-1] if starts else None,
    }
    if as_json:
        click.echo(json.dumps(report, indent=2, default=str))
    else:
        click.echo(format_status(roles, socket, answer, why, report["last_start"]))
    healthy = all(r.running for r in roles) and answer is not None
    sys.exit(ExitCode.OK if healthy else ExitCode.NOT_RUNNING)


@service.command("logs")
@_common
@click.option("-f", "--follow", is_flag=True, help="Keep printing new lines.")
@click.option(
    "-n", "--lines", default=200, show_default=True, help="Lines of history to show first."
)
def logs_cmd(dry_run, platform, config_file, follow, lines):
    """Show the logs: daemon.log (start and exit records, every daemon line) and the other
    processes' logs (their log files under launchd, the journal under systemd; the daemon's raw
    stderr, such as a hard crash's last words, is also in `journalctl --user -u moed.service`)."""
    s = _session(platform, config_file, dry_run)
    code = _guard(lambda: s.backend.logs(lines=lines, follow=follow))
    if code:
        sys.exit(code)


def daemon_status(socket: Path, timeout: float) -> tuple[dict | None, str | None]:
    """The daemon's own `status` answer, or why there is none."""
    try:
        client = Client(socket, timeout=timeout)
    except DaemonUnavailable as exc:
        return None, str(exc) or "not answering"
    except Exception as exc:  # a bad socket path must not hide the service manager's report
        return None, f"{type(exc).__name__}: {exc}"
    try:
        return client.status(), None
    except DaemonUnavailable as exc:
        return None, str(exc) or "not answering"
    except Exception as exc:
        return None, f"{type(exc).__name__}: {exc}"
    finally:
        client.close()


def format_status(
    roles: list[RoleStatus],
    socket: Path,
    answer: dict | None,
    why: str | None,
    last_start: dict | None,
) -> str:
    lines = []
    for r in roles:
        if r.error:
            lines.append(f"{r.role.value:9} {r.name}: cannot ask the service manager: {r.error}")
            continue
        if not r.loaded:
            lines.append(
                f"{r.role.value:9} {r.name}: not loaded "
                f"({'installed' if r.installed else 'not installed'})"
            )
            continue
        bits = ["running" if r.running else (r.state or "not running")]
        if r.pid:
            bits.append(f"pid {r.pid}")
        if r.runs is not None:
            bits.append(f"runs {r.runs}")
        if r.restarts:
            bits.append(f"restarts {r.restarts}")
        if r.last_exit:
            bits.append(f"last exit: {r.last_exit}")
        lines.append(f"{r.role.value:9} {r.name}: loaded, " + ", ".join(bits))
    if answer is not None:
        lines.append(f"daemon answers on {socket}:")
        lines += [f"  {line}" for line in format_daemon_answer(answer)]
    else:
        lines.append(f"daemon does not answer on {socket}" + (f" ({why})" if why else ""))
    if last_start:
        rest = ", ".join(f"{k} {v}" for k, v in last_start.items() if k not in ("time", "pid"))
        lines.append(f"last start {last_start.get('time')} (pid {last_start.get('pid')}): {rest}")
    return "\n".join(lines)


def format_daemon_answer(answer: dict) -> list[str]:
    """The daemon's own status, a few readable lines (`--json` has every field)."""
    model = answer.get("model") or {}
    kind = "streaming" if model.get("streaming") else "resident"
    keep = answer.get("keep_alive_s")
    return [
        f"state     {answer.get('state')} (pid {answer.get('pid')}, version "
        f"{answer.get('version')}, up {format_duration(answer.get('uptime_s'))})",
        f"model     {model.get('name') or '-'} ({model.get('model_type') or '?'}, {kind}) "
        f"at {model.get('path') or '-'}",
        f"requests  served {answer.get('requests_served')}, failed "
        f"{answer.get('requests_failed')}, active {answer.get('active_requests')}, queued "
        f"{answer.get('queued_requests')}",
        f"memory    rss {format_bytes(answer.get('rss_bytes'))}, idle model released "
        f"{'never' if keep is None or keep < 0 else 'after ' + format_duration(keep)}",
    ]
