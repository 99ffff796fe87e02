"""`moe stats` and `moe metrics`: the daemon's live counters, for people and for scrapers."""

from __future__ import annotations

import json
import sys
import time
from typing import Any, NoReturn

import click

from moed.protocol.units import format_bytes

from .cli_common import global_options, unavailable
from .client import Client
from .errors import DaemonRestarted, DaemonUnavailable, RequestFailed
from .exit_codes import ExitCode
from .offline import describe_crash

_bytes = format_bytes


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def _num(x: float | None, fmt: str = "{:.1f}", unit: str = "") -> str:
    return "-" if x is None else fmt.format(x) + unit


def format_stats(s: dict[str, Any]) -> str:
    """The human view of a `stats` body (one screen)."""
    model, req, tok, mem = (
        s.get("model") or {},
        s.get("requests") or {},
        s.get("tokens") or {},
        s.get("memory") or {},
    )
    lines = [
        f"moed {s.get('version')}  pid {s.get('pid')}  boot {str(s.get('boot_id'))[:8]}  "
        f"state {s.get('state')}  up {_num(s.get('uptime_s'), '{:.0f}', 's')}",
        f"model        {model.get('name')}  ({model.get('model_type')}, "
        f"{'streaming' if model.get('streaming') else 'resident'})",
        f"requests     served {req.get('served')}  failed {req.get('failed')}  "
        f"active {req.get('active')}  pending {req.get('pending')}",
        f"tokens       {tok.get('generated')} generated  {_num(tok.get('per_s'), unit=' tok/s')} "
        f"(last {_num(tok.get('window_s'), '{:.0f}', 's')})",
    ]
    ex = s.get("experts")
    if ex:
        slots = ex.get("slots_per_layer") or []
        lines += [
            f"budget       {_bytes(ex.get('budget_bytes'))}  "
            f"resident {_bytes(ex.get('resident_bytes'))} of "
            f"{_bytes(ex.get('experts_bytes'))} experts  "
            f"({min(slots) if slots else '-'} of {ex.get('num_experts')} slots/layer, "
            f"{_page_cache(ex)})",
            f"hit rate     {_pct(ex.get('hit_rate'))} overall  "
            f"{_pct(ex.get('recent_hit_rate'))} recent  "
            f"({ex.get('hits')} hits, {ex.get('misses')} misses)",
            "per layer    " + " ".join(f"{r:.0%}" for r in ex.get("layer_hit_rates") or []),
            f"reads        {_bytes(ex.get('bytes_read'))} total  "
            f"{_bytes(ex.get('bytes_read_per_token'))}/token  "
            f"{_bytes(ex.get('read_bandwidth_bps'))}/s while stalled  "
            f"{_bytes(ex.get('recent_bytes_read_per_s'))}/s recent",
            f"read ahead   {_bytes(ex.get('prefetch_bytes'))}  prompt ends "
            f"{ex.get('prompt_end_hits', 0)} of {ex.get('prompt_end_reads', 0)} experts used",
            f"per token    stall {_num(ex.get('stall_ms_per_token'), '{:.2f}', ' ms')}  "
            f"router read-back {_num(ex.get('router_readback_ms_per_token'), '{:.2f}', ' ms')}  "
            f"({ex.get('tokens')} routed tokens)",
        ]
    else:
        lines.append("experts      resident (no expert streaming)")
    pc = s.get("prefix_cache")
    if pc:
        lines.append(
            f"prefix cache {pc.get('hits')} hits of {pc.get('lookups')}  "
            f"{pc.get('tokens_reused')} tokens reused  "
            f"memory {_bytes(pc.get('memory_bytes'))} of {_bytes(pc.get('memory_budget_bytes'))}"
            + (
                f"  disk {_bytes(pc.get('disk_bytes'))} of {_bytes(pc.get('disk_budget_bytes'))}"
                if pc.get("disk_budget_bytes") is not None
                else ""
            )
            + f"  evictions {pc.get('memory_evictions')}"
            + (f"/{pc.get('disk_evictions')}" if pc.get("disk_evictions") is not None else "")
            # Entry files passed over (corrupt, foreign, not a file): --json says why.
            + (f"  disk skipped {pc['disk_skipped']}" if pc.get("disk_skipped") else "")
        )
    models = s.get("models") or []
    if len(models) > 1:  # one model is the figures above; several each get a line by name
        lines += [_model_line(m) for m in models]
    phys = mem.get("phys_footprint_bytes")
    lines.append(
        f"memory       rss {_bytes(mem.get('rss_bytes'))}"
        + (f"  footprint {_bytes(phys)}" if phys is not None else "")
        + f"  swap {_bytes(mem.get('swap_used_bytes'))}  pressure {mem.get('pressure')}"
    )
    crash = s.get("last_crash")
    lines.append(
        f"restarts     {s.get('restarts') if s.get('restarts') is not None else '-'}  "
        f"last crash {describe_crash(crash) if crash else '-'}"
    )
    return "\n".join(lines)


def _model_line(m: dict[str, Any]) -> str:
    """One served model's own figures (the `stats` body's `models`)."""
    req, tok = m.get("requests") or {}, m.get("tokens") or {}
    ex, pc = m.get("experts"), m.get("prefix_cache")
    return (
        f"model {m.get('name')}  {'loaded' if m.get('loaded') else 'unloaded'}  "
        f"served {req.get('served')}  failed {req.get('failed')}  active {req.get('active')}  "
        f"tokens {tok.get('generated')}"
        + (f"  hit rate {_pct(ex.get('hit_rate'))}" if ex else "")
        + (f"  prefix cache {pc.get('hits')} hits of {pc.get('lookups')}" if pc else "")
    )


def _body(msg: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in msg.items() if k not in ("v", "type", "id")}


def _fail(code: ExitCode, message: str) -> NoReturn:
    click.echo(f"moe: {message}", err=True)
    sys.exit(code)


@click.command()
@click.option("--json", "as_json", is_flag=True, help="One JSON object (per refresh with --watch).")
@click.option("--watch", is_flag=True, help="Refresh in place until interrupted.")
@click.option(
    "--interval",
    type=float,
    default=1.0,
    show_default=True,
    help="Seconds between refreshes with --watch.",
)
@click.pass_obj
def stats(obj: dict[str, Any], as_json: bool, watch: bool, interval: float) -> None:
    """Live counters: expert cache, reads, stalls, tokens/s, memory, requests."""
    try:
        with Client(global_options().socket_path, timeout=obj["timeout"]) as client:
            while True:
                try:
                    body = _body(client.stats())
                except DaemonRestarted as exc:
                    if not watch:
                        raise
                    click.echo(f"moe: {exc}; following the new daemon", err=True)
                    continue
                if as_json:
                    click.echo(json.dumps(body, default=str))
                else:
                    if watch and sys.stdout.isatty():
                        click.echo("\x1b[H\x1b[2J", nl=False)  # home + clear: refresh in place
                    click.echo(format_stats(body))
                    if watch and not sys.stdout.isatty():
                        click.echo("")
                if not watch:
                    return
                time.sleep(interval)
    except KeyboardInterrupt:
        return
    except (DaemonUnavailable, DaemonRestarted) as exc:
        _fail(ExitCode.DAEMON_UNAVAILABLE, unavailable(exc))
    except RequestFailed as exc:
        _fail(ExitCode.REQUEST_FAILED, str(exc))


@click.command()
@click.pass_obj
def metrics(obj: dict[str, Any]) -> None:
    """Print the Prometheus text exposition of the daemon's counters."""
    try:
        with Client(global_options().socket_path, timeout=obj["timeout"]) as client:
            text = client.metrics().get("text", "")
    except (DaemonUnavailable, DaemonRestarted) as exc:
        _fail(ExitCode.DAEMON_UNAVAILABLE, unavailable(exc))
    except RequestFailed as exc:
        _fail(ExitCode.REQUEST_FAILED, str(exc))
    click.echo(text, nl=False)


def _page_cache(ex: dict[str, Any]) -> str:
    if not ex.get("page_cache_bypass"):
        return "page cache trusted"
    return "page cache bypassed, O_DIRECT" if ex.get("direct_io") else "page cache bypassed"
