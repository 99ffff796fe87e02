"""`moe`: the thin command-line client. Never imports mlx: it starts in well under a second."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, NoReturn

import click

from moed.protocol.units import format_bytes, format_duration

from .cache_cli import cache as _cache
from .cli_common import (
    CONTEXT_SETTINGS,
    add_global_options,
    fail,
    global_options,
    json_line,
    unavailable,
)
from .client import Client
from .errors import DaemonNotRunning, DaemonUnavailable, InsecureSocket, RequestFailed
from .exit_codes import ExitCode
from .liveness import process_gone
from .load_cli import load as _load
from .load_cli import unload as _unload
from .models_cli import list_cmd as _list
from .models_cli import ps as _ps
from .models_cli import pull as _pull
from .models_cli import rm as _rm
from .offline import describe_crash, describe_watchdog, offline_lines, offline_state
from .recovery_view import recovery_line
from .run_cli import run as _run
from .stats_cli import metrics as _metrics
from .stats_cli import stats as _stats


class _Moe(click.Group):
    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except InsecureSocket as exc:  # any command: one line, as `moed serve` says it
            fail(ExitCode.USAGE, str(exc))


@click.group(cls=_Moe, context_settings=CONTEXT_SETTINGS)
@click.version_option(package_name="moed", prog_name="moe")
@click.option(
    "--timeout",
    type=float,
    default=10.0,
    show_default=True,
    help="Seconds to wait for a control answer.",
)
@click.pass_context
def main(ctx: click.Context, timeout: float) -> None:
    """moe: talk to the moed daemon (run prompts, status, stop) and manage local models.

    Shell completion: eval "$(_MOE_COMPLETE=bash_source moe)" (zsh_source, fish_source).
    """
    ctx.obj = {"timeout": timeout}


def _socket() -> Path:
    return global_options().socket_path


def _fail(exit_code: ExitCode, message: str, as_json: bool = False, **fields: Any) -> NoReturn:
    fail(exit_code, message, as_json, **fields)


@main.command()
@click.option("--json", "as_json", is_flag=True, help="The status body as one JSON object.")
@click.pass_obj
def status(obj: dict[str, Any], as_json: bool) -> None:
    """Show the daemon's state (exit 3 when none answers, with its last crash and the watchdog's
    last action from --state-dir)."""
    try:
        with Client(_socket(), timeout=obj["timeout"]) as client:
            body = client.status()
    except InsecureSocket as exc:
        _fail(ExitCode.USAGE, str(exc), as_json, code="insecure_socket")
    except DaemonUnavailable as exc:
        offline = offline_state(global_options().state_path)
        not_running = isinstance(exc, DaemonNotRunning)
        if not as_json:
            if not_running:
                click.echo("state        not running", err=True)
            for line in offline_lines(offline):
                click.echo(line, err=True)
        code = "not_running" if not_running else "daemon_unavailable"
        _fail(ExitCode.DAEMON_UNAVAILABLE, unavailable(exc), as_json, code=code, **offline)
    except RequestFailed as exc:
        _fail(ExitCode.REQUEST_FAILED, str(exc), as_json, code=getattr(exc.code, "value", exc.code))
    body = {k: v for k, v in body.items() if k not in ("v", "type", "id")}
    if as_json:
        json_line(body)
        return
    click.echo(format_status(body))


def format_status(body: dict[str, Any]) -> str:
    model = body.get("model") or {}
    lines = [
        f"state        {body.get('state')}  (pid {body.get('pid')}, "
        f"boot {str(body.get('boot_id'))[:8]}, up {format_duration(body.get('uptime_s'))})",
        f"model        {model.get('name')}  ({model.get('model_type')}, "
        f"{'streaming' if model.get('streaming') else 'resident'})",
        f"requests     active {body.get('active_requests')}  "
        f"pending {body.get('pending_requests')}  "
        f"served {body.get('requests_served')}  failed {body.get('requests_failed')}",
        f"tokens       {body.get('tokens_generated')}",
        f"memory       rss {format_bytes(body.get('rss_bytes'))}",
    ]
    for rank in body.get("ranks") or []:  # a pipeline: one line per rank
        experts = rank.get("experts") or {}
        hit = experts.get("hit_rate")
        lines.append(
            f"rank {rank.get('rank'):<7} {rank.get('host')} pid {rank.get('pid')}  "
            f"layers {rank.get('layers')}  rss {format_bytes(rank.get('rss_bytes'))}  "
            f"experts {format_bytes(experts.get('resident_bytes'))}"
            + (f"  hits {hit:.1%}  reads {experts.get('reads')}" if hit is not None else "")
            + (
                f"  prefix ssd {disk.get('disk_entries')} entries "
                f"{format_bytes(disk.get('disk_bytes'))}"
                if (disk := rank.get("prefix_disk"))
                else ""
            )
        )
    keep = body.get("keep_alive_s")
    if keep is not None:
        after = "never" if keep < 0 else f"after {format_duration(keep)} idle"
        note = "  (released; the next request reloads it)" if body.get("state") == "idle" else ""
        lines.append(f"keep-alive   model released {after}{note}")
    if (load := body.get("load")) and load.get("stage") != "ready":
        lines.append(f"loading      {load.get('stage')}: {load.get('done')} of {load.get('total')}")
    if recovery := recovery_line(body):  # device failures met in place, or why not
        lines.append(f"recovery     {recovery}")
    if body.get("last_crash"):
        lines.append(f"last crash   {describe_crash(body['last_crash'])}")
    if body.get("watchdog"):
        lines.append(f"watchdog     {describe_watchdog(body['watchdog'])}")
    return "\n".join(lines)


@main.command()
@click.option(
    "--reason",
    default="moe stop",
    show_default=True,
    help="Why, for the daemon's log (the watchdog and the service manager give their own).",
)
@click.option(
    "--wait",
    type=float,
    default=60.0,
    show_default=True,
    help="Seconds to wait for the daemon to exit (0: ask and return).",
)
@click.pass_obj
def stop(obj: dict[str, Any], reason: str, wait: float) -> None:
    """Ask the daemon to drain and exit, and wait until it has."""
    try:
        with Client(_socket(), timeout=obj["timeout"]) as client:
            client.shutdown(reason)
            pid = (client.welcome or {}).get("pid")
    except InsecureSocket as exc:
        _fail(ExitCode.USAGE, str(exc))
    except DaemonNotRunning as exc:
        _fail(ExitCode.DAEMON_UNAVAILABLE, f"{exc}; nothing to stop")
    except DaemonUnavailable as exc:
        _fail(ExitCode.DAEMON_UNAVAILABLE, unavailable(exc))
    click.echo("moe: daemon stopping", err=True)
    # Until the process is gone: a `moe status` or `moe run` right after sees no daemon, not
    # one half way out (it drains its requests first, up to its drain_timeout_s).
    deadline = time.monotonic() + (wait if isinstance(pid, int) else 0)
    while not process_gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if process_gone(pid):
        click.echo("moe: daemon stopped", err=True)
    elif wait > 0:
        click.echo(f"moe: daemon still draining (pid {pid}) after {wait:g}s", err=True)


main.add_command(_run)
main.add_command(_stats)
main.add_command(_metrics)
main.add_command(_cache)
for _command in (_pull, _list, _rm, _ps, _load, _unload):
    main.add_command(_command)
add_global_options(main)  # last: every command above (and any added) takes the global options


if __name__ == "__main__":
    main()
