"""`moe load X`, `moe unload X`: load a servable model into the daemon now, or release one once
it is idle (the `models` verb; `moe ps` shows the result)."""

from __future__ import annotations

from typing import Any

import click

from .cli_common import fail, global_options, json_line, unavailable
from .client import Client
from .errors import DaemonUnavailable, RequestFailed
from .exit_codes import ExitCode


def _models_verb(obj: dict[str, Any], action: str, model: str, as_json: bool) -> None:
    try:
        with Client(global_options().socket_path, timeout=obj["timeout"]) as client:
            reply = client.models(action, model)
    except DaemonUnavailable as exc:
        fail(ExitCode.DAEMON_UNAVAILABLE, unavailable(exc), as_json, code="daemon_unavailable")
    except RequestFailed as exc:
        fail(ExitCode.REQUEST_FAILED, str(exc), as_json, code=getattr(exc.code, "value", exc.code))
    if as_json:
        json_line({"type": action, "model": reply.get("model"), "accepted": reply.get("accepted")})
    elif action == "load":
        click.echo(f"loading {reply.get('model')} (`moe ps` shows it loaded)")
    else:
        waiting = reply.get("requests") or 0
        later = f" once its {waiting} request(s) end" if waiting else ""
        click.echo(f"unloading {reply.get('model')}{later}")


@click.command()
@click.argument("model")
@click.option("--json", "as_json", is_flag=True, help="One JSON object instead of a sentence.")
@click.pass_obj
def load(obj: dict[str, Any], model: str, as_json: bool) -> None:
    """Load MODEL (any servable name: `[models]` alias, Hub id, folder, demo) into the running
    daemon now; the least recently used idle models make room if the memory plan needs it."""
    _models_verb(obj, "load", model, as_json)


@click.command()
@click.argument("model")
@click.option("--json", "as_json", is_flag=True, help="One JSON object instead of a sentence.")
@click.pass_obj
def unload(obj: dict[str, Any], model: str, as_json: bool) -> None:
    """Release MODEL and its expert cache once it is idle (at once if it is)."""
    _models_verb(obj, "unload", model, as_json)
