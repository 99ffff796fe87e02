"""`moe`: the thin command-line client. Never imports mlx: it starts in well under a second."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from moed.protocol.units import format_bytes, format_duration

from .cache_cli import cache as _cache
from .cli_common import CONTEXT_SETTINGS, add_global_options, fail, global_options, json_line
from .client import Client
from .errors import DaemonUnavailable, RequestFailed
from .exit_codes import ExitCode
from .models_cli import list_cmd as _list
from .models_cli import ps as _ps
from .models_cli import pull as _pull
from .models_cli import rm as _rm
from .run_cli import run as _run
from .stats_cli import metrics as _metrics
from .stats_cli import stats as _stats


@click.group(context_settings=CONTEXT_SETTINGS)
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


def _fail(exit_code: ExitCode, message: str, as_json: bool = False, **fields: Any) -> None:
    fail(exit_code, message, as_json, **fields)


def offline_state(state_dir: Path) -> dict:
    """What the state directory says when no daemon answers: the last crash and the watchdog's
    last word."""
    out = {}
    for key, name, field in (
        ("last_crash", "crash.json", "last"),
        ("watchdog", "watchdog.json", None),
    ):
        try:
            data = json.loads((state_dir / name).read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(data, dict):
            continue  # a misshapen file says nothing (the daemon sets it aside at its next start)
        value = (
            data.get(field)
            if field
            else {k: data.get(k) for k in ("state", "last_action", "updated_at")}
        )
        out[key] = value if isinstance(value, dict) else None
    return out


@main.command()
@click.option("--json", "as_json", is_flag=True, help="The status body as one JSON object.")
@click.pass_obj
def status(obj, as_json: bool) -> None:
    """Show the daemon's state (exit 3 when none answers, with its last crash and the watchdog's
    last action from --state-dir)."""
    try:
        with Client(_socket(), timeout=obj["timeout"]) as client:
            body = client.status()
    except DaemonUnavailable as exc:
        offline = offline_state(global_options().state_path)
        for key, value in offline.items():
            if not as_json and value:
                click.echo(f"{key:<12} {json.dumps(value, default=str)}", err=True)
        _fail(ExitCode.DAEMON_UNAVAILABLE, str(exc), as_json, code="daemon_unavailable", **offline)
    except RequestFailed as exc:
        _fail(ExitCode.REQUEST_FAILED, str(exc), as_json, code=getattr(exc.code, "value", exc.code))
    body = {k: v for k, v in body.items() if k not in ("v", "type", "id")}
    if as_json:
        json_line(body)
        return
    click.echo(format_status(body))


def format_status(body: dict) -> str:
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
    for key in ("last_crash", "watchdog"):
        if body.get(key):
            lines.append(f"{key:<12} {json.dumps(body[key], default=str)}")
    return "\n".join(lines)


@main.command()
@click.option(
    "--reason",
    default="moe stop",
    show_default=True,
    help="Why, for the daemon's log (the watchdog and the service manager give their own).",
)
@click.pass_obj
def stop(obj, reason: str) -> None:
    """Ask the daemon to drain and exit."""
    try:
        with Client(_socket(), timeout=obj["timeout"]) as client:
            client.shutdown(reason)
    except DaemonUnavailable as exc:
        _fail(ExitCode.DAEMON_UNAVAILABLE, str(exc))
    click.echo("moe: daemon stopping", err=True)


main.add_command(_run)
main.add_command(_stats)
main.add_command(_metrics)
main.add_command(_cache)
for _command in (_pull, _list, _rm, _ps):
    main.add_command(_command)
add_global_options(main)  # last: every command above (and any added) takes the global options


if __name__ == "__main__":
    main()
