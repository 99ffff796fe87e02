"""`moe pull`, `moe list`, `moe rm`, `moe ps`: the models on this machine and the one loaded."""

from __future__ import annotations

import time
from typing import Any

import click

from moed.protocol.units import format_bytes, format_duration

from .cli_common import fail, global_options, json_line, unavailable
from .client import Client
from .errors import DaemonUnavailable, RequestFailed
from .exit_codes import ExitCode
from .progress import Progress, Unit, progress_mode
from .recovery_view import last_recovery_text

JSON_HELP = "One JSON object per line instead of a table."


@click.command()
@click.argument("repo_id")
@click.option("--revision", help="Branch, tag or commit to pull (default: main).")
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="JSON lines: progress events, then a `pulled` (or `error`) object.",
)
def pull(repo_id: str, revision: str | None, as_json: bool) -> None:
    """Download REPO_ID (org/name) from Hugging Face into the local cache, only the files mlx-lm
    needs, and verify every safetensors header. Run it again to resume an interrupted pull."""
    from .hub import PullError
    from .hub import pull as pull_model

    bar = Progress(f"pull {repo_id}", progress_mode(as_json), unit=Unit.BYTES)
    try:
        result = pull_model(
            repo_id, revision, lambda done, total, name: bar.update(done, total, name or None)
        )
    except PullError as exc:
        bar.close(done=False)
        fail(ExitCode.MODEL_UNAVAILABLE, str(exc), as_json, code="pull_failed")
    except KeyboardInterrupt:
        bar.close(done=False)
        fail(ExitCode.INTERRUPTED, "interrupted; run the pull again to resume", as_json)
    bar.close()
    if as_json:
        json_line(
            {
                "type": "pulled",
                "name": result.repo_id,
                "commit": result.commit,
                "path": str(result.path),
                "files": result.files,
                "size_bytes": result.total_bytes,
                "downloaded_bytes": result.downloaded_bytes,
                "verified_shards": result.verified_shards,
            }
        )
        return
    fetched = (
        f"{format_bytes(result.downloaded_bytes)} downloaded"
        if result.downloaded_bytes
        else "already in the cache"
    )
    click.echo(
        f"{result.repo_id}: {result.files} files, {format_bytes(result.total_bytes)} ({fetched}), "
        f"{result.verified_shards} shard(s) verified\n"
        f"serve it with: moed serve --model {result.repo_id}"
    )


@click.command("list")
@click.option("--all", "show_all", is_flag=True, help="Also list models moed cannot serve.")
@click.option("--json", "as_json", is_flag=True, help=JSON_HELP)
def list_cmd(show_all: bool, as_json: bool) -> None:
    """Models moed can serve: the built-in demo and those in the local Hugging Face cache (size,
    MoE or not, experts)."""
    from .hub import cached_models, demo_model

    demo = demo_model()
    models = [m for m in [demo, *cached_models()] if m and (show_all or m.servable)]
    if as_json:
        for m in models:
            json_line({"type": "model", **m.to_json()})
        return
    if not models:
        click.echo("no servable models in the Hugging Face cache; try: moe pull <org/name>")
        return
    rows = [("NAME", "SIZE", "TYPE", "EXPERTS", "")]
    for m in models:
        experts = f"{m.num_experts} x top-{m.experts_per_token}" if m.is_moe else "dense"
        note = "built in, the default of `moe run` (a toy: MODEL_CARD.md)" if m.builtin else ""
        rows.append(
            (
                m.repo_id,
                format_bytes(m.size_bytes),
                m.model_type or "?",
                experts,
                m.why_not or note,
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        click.echo("  ".join(c.ljust(w) for c, w in zip(r[:4], widths)) + f"  {r[4]}".rstrip())


@click.command()
@click.argument("repo_id")
@click.option("--force", is_flag=True, help="Remove it even though the running daemon serves it.")
@click.pass_obj
def rm(obj: dict[str, Any], repo_id: str, force: bool) -> None:
    """Remove REPO_ID from the local Hugging Face cache (every revision)."""
    from .hub import cached_models, remove

    served = _served_path(obj)
    mine = [m for m in cached_models() if m.repo_id == repo_id]
    if served and mine and not force and str(mine[0].path.parent.parent) in served:
        fail(
            ExitCode.USAGE,
            f"the running daemon serves {repo_id}; `moe stop` it first (or pass --force)",
        )
    try:
        freed, folder = remove(repo_id)
    except KeyError:
        fail(ExitCode.MODEL_UNAVAILABLE, f"{repo_id} is not in the Hugging Face cache")
    click.echo(f"removed {repo_id} ({format_bytes(freed)}) from {folder.parent}")


def _served_path(obj: dict[str, Any]) -> str | None:
    try:
        with Client(global_options().socket_path, timeout=min(obj["timeout"], 2.0)) as client:
            return (client.status().get("model") or {}).get("path")
    except (DaemonUnavailable, RequestFailed):
        return None


@click.command()
@click.option("--json", "as_json", is_flag=True, help=JSON_HELP)
@click.pass_obj
def ps(obj: dict[str, Any], as_json: bool) -> None:
    """The daemon's models: the started one first, then every other loaded one; state (ready,
    idle, loading, recovering), memory, cache budget, idle time, pinned, requests, the last
    recovery in place from a device failure."""
    try:
        with Client(global_options().socket_path, timeout=obj["timeout"]) as client:
            status = client.status()
    except DaemonUnavailable as exc:
        fail(ExitCode.DAEMON_UNAVAILABLE, unavailable(exc), as_json, code="daemon_unavailable")
    except RequestFailed as exc:
        fail(ExitCode.REQUEST_FAILED, str(exc), as_json, code=getattr(exc.code, "value", exc.code))
    rows = ps_rows(status)
    if as_json:
        for row in rows:
            json_line({"type": "model", **row})
        return
    table = [
        [
            ("NAME", row["name"] or "-"),
            ("STATE", row["state"] or "-"),
            ("MEMORY", format_bytes(row["memory_bytes"] or row["rss_bytes"])),
            ("BUDGET", _budget(row)),
            ("IDLE", format_duration(row["idle_s"])),
            ("UNLOADS", _unloads(row)),
            ("PINNED", "yes" if row["pinned"] else "no"),
            ("REQUESTS", str(row["active_requests"] or 0)),
            ("RECOVERY", last_recovery_text(row["last_recovery"])),
        ]
        for row in rows
    ]
    widths = [max(len(h), *(len(r[i][1]) for r in table)) for i, (h, _) in enumerate(table[0])]
    click.echo("  ".join(h.ljust(w) for (h, _), w in zip(table[0], widths)))
    for cols in table:
        click.echo("  ".join(v.ljust(w) for (_, v), w in zip(cols, widths)))


def _budget(row: dict[str, Any]) -> str:
    if row["state"] == "idle":
        return "released"
    if row["budget_bytes"]:
        return format_bytes(row["budget_bytes"])
    return row.get("budget") or "resident"


def ps_rows(status: dict[str, Any]) -> list[dict[str, Any]]:
    """The started model's row (from the status itself), then one per other loaded model."""
    started = ps_row(status)
    rows = [started]
    for model in status.get("models") or []:
        if model.get("path") == started["path"]:
            started.update(memory_bytes=model.get("memory_bytes"), pinned=model.get("pinned"))
            continue
        rows.append(
            {
                **dict.fromkeys(started, None),
                **{k: model.get(k) for k in ("name", "path", "state", "idle_s", "keep_alive_s")},
                "memory_bytes": model.get("memory_bytes"),
                "budget": model.get("cache_budget"),
                "pinned": model.get("pinned"),
                "active_requests": model.get("requests"),
                "recoveries": {},
            }
        )
    return rows


def _unloads(row: dict[str, Any]) -> str:
    """When the keep-alive releases the model: like ollama's UNTIL column."""
    keep = row["keep_alive_s"]
    if row["state"] == "idle":
        return "unloaded"
    if keep is None or keep < 0:
        return "never"
    if row["idle_s"] is None:  # a request is running: the clock starts when it ends
        return f"{format_duration(keep)} after use"
    return f"in {format_duration(max(0.0, keep - row['idle_s']))}"


def ps_row(status: dict[str, Any]) -> dict[str, Any]:
    model = status.get("model") or {}
    streaming = status.get("streaming") or {}
    last = status.get("last_activity_at") or status.get("last_token_at") or status.get("started_at")
    now = status.get("time") or time.time()
    return {
        "name": model.get("name"),
        "path": model.get("path"),
        "state": status.get("state"),
        "rss_bytes": status.get("rss_bytes"),
        "budget_bytes": streaming.get("budget_bytes"),
        "idle_s": None if status.get("busy") else max(0.0, now - (last or now)),
        "keep_alive_s": status.get("keep_alive_s"),
        "active_requests": status.get("active_requests"),
        "memory_bytes": None,  # the model's memory plan (from `models`), else RSS is shown
        "pinned": False,
        # Device failures recovered in place, by kind, and the last one (what it shed).
        "recoveries": status.get("recoveries") or {},
        "last_recovery": status.get("last_recovery"),
    }
