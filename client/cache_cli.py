"""`moe cache list|clear`: the daemon's prefix KV cache (what the turns of a conversation reuse)."""

from __future__ import annotations

import json
import sys
import time
from typing import Any, NoReturn

import click

from moed.protocol.units import format_bytes

from .cli_common import global_options, unavailable
from .client import Client
from .errors import DaemonUnavailable, RequestFailed
from .exit_codes import ExitCode


def _client(obj: dict[str, Any]) -> Client:
    return Client(global_options().socket_path, timeout=obj["timeout"])


def _fail(code: ExitCode, message: str) -> NoReturn:
    click.echo(f"moe: {message}", err=True)
    sys.exit(code)


def format_entries(body: dict[str, Any]) -> str:
    if not body.get("enabled"):
        return "prefix cache off (or no model loaded)"
    rows = [f"{'key':<16} {'tokens':>7} {'checkpoints':>11} {'size':>9}  tiers        last used"]
    now = time.time()
    for e in body.get("entries") or []:
        rows.append(
            f"{e['key'][:16]:<16} {e['tokens']:>7} {e['checkpoints']:>11} "
            f"{format_bytes(e['bytes']):>9}  {','.join(e['tiers']):<12} "
            f"{now - e['last_used']:.0f}s ago"
        )
    return "\n".join(rows)


@click.group()
def cache() -> None:
    """The prefix KV cache: list its entries or clear it."""


_MODEL = click.option("--model", help="Which model's cache (default: the started model).")


@cache.command("list")
@click.option("--json", "as_json", is_flag=True, help="The reply as one JSON object.")
@_MODEL
@click.pass_obj
def list_entries(obj: dict[str, Any], as_json: bool, model: str | None) -> None:
    """Cached prefixes, most recently used first, in memory and on the SSD."""
    try:
        with _client(obj) as client:
            reply = client.prefix_cache("list", model=model)
            body = {k: v for k, v in reply.items() if k not in ("v", "id")}
    except DaemonUnavailable as exc:
        _fail(ExitCode.DAEMON_UNAVAILABLE, unavailable(exc))
    except RequestFailed as exc:
        _fail(ExitCode.REQUEST_FAILED, f"{getattr(exc.code, 'value', exc.code)}: {exc}")
    body.pop("type", None)
    click.echo(json.dumps(body) if as_json else format_entries(body))


@cache.command("clear")
@_MODEL
@click.pass_obj
def clear(obj: dict[str, Any], model: str | None) -> None:
    """Empty both tiers (the daemon's owner only)."""
    try:
        with _client(obj) as client:
            client.prefix_cache("clear", model=model)
    except DaemonUnavailable as exc:
        _fail(ExitCode.DAEMON_UNAVAILABLE, unavailable(exc))
    except RequestFailed as exc:
        _fail(ExitCode.REQUEST_FAILED, f"{getattr(exc.code, 'value', exc.code)}: {exc}")
    click.echo("moe: prefix cache cleared", err=True)
