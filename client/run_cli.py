"""`moe run`: stream a generation, starting a daemon (with load progress) when none answers."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, NoReturn

import click

from moed.protocol import Channel
from moed.protocol.messages import PROMPT_STAGE
from moed.protocol.units import format_bytes

from .cli_common import fail, global_options, unavailable
from .client import Client
from .errors import DaemonRestarted, DaemonUnavailable, InsecureSocket, RequestFailed
from .events import DoneEvent, Event, ProgressEvent, TelemetryEvent, TokenEvent, TraceEvent
from .exit_codes import ExitCode
from .progress import StagedProgress, progress_mode
from .trace_file import TraceFile


def _socket() -> Path:
    return global_options().socket_path


def _fail(exit_code: ExitCode, message: str, as_json: bool = False, **fields: Any) -> NoReturn:
    fail(exit_code, message, as_json, **fields)


@click.command()
@click.argument("prompt", required=False)
@click.option("--max-tokens", type=int, help="Tokens to generate (default: the daemon's).")
@click.option(
    "--temperature",
    type=float,
    default=0.0,
    show_default=True,
    help="Sampling temperature; 0 is greedy (the same text every time).",
)
@click.option(
    "--top-p",
    type=float,
    default=1.0,
    show_default=True,
    help="Nucleus sampling: draw from the smallest set of tokens whose probability reaches P.",
)
@click.option("--seed", type=int, help="Seed for sampling (reproducible run to run).")
@click.option("--raw", is_flag=True, help="Send the prompt as is, without the chat template.")
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="One JSON object per line: progress, token, telemetry, then done or error.",
)
@click.option(
    "--no-start", is_flag=True, help="Fail instead of starting a daemon when none is running."
)
@click.option(
    "--model",
    help="Model to use (default: the daemon's, or the demo model). Starts a daemon on it when "
    "none runs; a running daemon loads any servable model on request (`moe ps` lists them), "
    "and refuses an unknown one with model_not_found (exit 4).",
)
@click.option(
    "--start-timeout",
    type=float,
    default=300.0,
    show_default=True,
    help="Seconds to wait for a started daemon.",
)
@click.option(
    "--trace",
    "trace_path",
    type=click.Path(path_type=Path, dir_okay=False),
    help="Write the router trace of this generation to FILE (read it with `moed trace analyze`).",
)
@click.option(
    "--resume",
    is_flag=True,
    help="If the daemon restarts mid-stream, wait for it and continue where the text left off.",
)
@click.option(
    "--keep-alive",
    help="How long the daemon keeps the model loaded after this request: 30s, 5m, 1h, 0 "
    "(release it at once) or -1 (never); default: the daemon's keep_alive.",
)
@click.pass_obj
def run(
    obj: dict[str, Any],
    prompt: str | None,
    max_tokens: int | None,
    temperature: float,
    top_p: float,
    seed: int | None,
    raw: bool,
    as_json: bool,
    no_start: bool,
    model: str | None,
    start_timeout: float,
    trace_path: Path | None,
    resume: bool,
    keep_alive: str | None,
) -> None:
    """Generate from PROMPT (or stdin with '-') and stream the text."""
    if prompt is None or prompt == "-":
        prompt = sys.stdin.read()
    if not prompt:
        _fail(ExitCode.USAGE, "empty prompt", as_json)
    client = _connect_or_start(_socket(), obj["timeout"], no_start, model, start_timeout, as_json)
    _note_capped(client, max_tokens)
    # Said once the demo answers (a --model the daemon refuses gets the refusal alone).
    started_demo = ((client.welcome or {}).get("model") or {}).get("demo")
    demo_note = not as_json and started_demo and model in (None, "demo")
    events = client.generate(
        prompt,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        raw=raw,
        model=served_name(model),
        trace=trace_path is not None,
        progress=True,  # a long prompt shows a bar while it is read
        resume=resume,
        keep_alive=keep_alive,
    )
    trace_out = TraceFile(trace_path) if trace_path else None
    loading = StagedProgress("loading", progress_mode(as_json))  # after an idle unload
    reading = StagedProgress("prompt", progress_mode(as_json))  # a long prompt, chunk by chunk
    try:
        for event in events:
            if isinstance(event, TraceEvent):
                if trace_out is not None:
                    trace_out.write(event)
                continue
            if isinstance(event, ProgressEvent):
                bar = reading if event.stage == PROMPT_STAGE else loading
                # A prompt of one chunk gets no bar: only one with chunks still to read.
                if bar is loading or bar.stage or 0 < event.done < (event.total or 0):
                    bar.update(event.stage, event.done, event.total, event.unit)
                continue
            loading.close()
            reading.close()
            if demo_note:
                click.echo(DEMO_NOTE, err=True)
                demo_note = False
            _print_event(event, as_json)
    except KeyboardInterrupt:
        try:
            client.cancel(client.last_request_id)
        except Exception:
            pass
        _fail(ExitCode.INTERRUPTED, "interrupted; request cancelled", as_json, code="cancelled")
    except RequestFailed as exc:
        _fail(
            ExitCode.REQUEST_FAILED,
            str(exc),
            as_json,
            code=getattr(exc.code, "value", exc.code),
            retryable=exc.retryable,
        )
    except DaemonRestarted as exc:
        _fail(ExitCode.DAEMON_RESTARTED, str(exc), as_json, code="daemon_restarted", retryable=True)
    except DaemonUnavailable as exc:
        _fail(
            ExitCode.DAEMON_RESTARTED, str(exc), as_json, code="daemon_unavailable", retryable=True
        )
    finally:
        client.close()
        if trace_out is not None:
            trace_out.close()


DEMO_NOTE = (
    "[moe] demo model: a 14.6 MB MoE trained for minutes on Python's standard library, so the "
    "text looks like Python and makes little sense (MODEL_CARD.md); `moe pull` a real model"
)


def served_name(model: str | None) -> str | None:
    """The name to check against the served model: a local folder as the absolute path the
    daemon resolved it to (`./m` and `/abs/m` are the same model); anything else as given."""
    if model is None:
        return None
    path = Path(model).expanduser()
    return str(path.resolve()) if path.is_dir() else model


def _note_capped(client: Client, max_tokens: int | None) -> None:
    """Say so when the daemon will stop short of --max-tokens (its limit caps every request)."""
    limit = ((client.welcome or {}).get("limits") or {}).get("max_tokens")
    if max_tokens is not None and limit is not None and max_tokens > limit:
        click.echo(
            f"moe: --max-tokens {max_tokens} is over this daemon's limit; capped at {limit} "
            "(max_tokens_limit in the daemon's config)",
            err=True,
        )


def _connect_or_start(
    socket_path: Path,
    timeout: float,
    no_start: bool,
    model: str | None,
    start_timeout: float,
    as_json: bool,
) -> Client:
    client = Client(socket_path, timeout=timeout)
    try:
        client.connect()
        return client
    except InsecureSocket as exc:  # nothing was sent, and no daemon is started there either
        _fail(ExitCode.USAGE, str(exc), as_json, code="insecure_socket")
    except DaemonUnavailable as exc:
        client.close()
        if no_start:
            _fail(
                ExitCode.DAEMON_UNAVAILABLE,
                f"{unavailable(exc)} (and --no-start was given)",
                as_json,
                code="daemon_unavailable",
            )
    except RequestFailed as exc:
        _fail(ExitCode.REQUEST_FAILED, str(exc), as_json, code=getattr(exc.code, "value", exc.code))
    from .autostart import log_path_for, start_daemon, wait_until_ready

    click.echo(
        f"moe: no daemon on {socket_path}; starting one (log: {log_path_for(socket_path)})",
        err=True,
    )
    given = global_options()
    passed = [
        arg
        for flag, value in (("--state-dir", given.state_dir), ("--log-dir", given.log_dir))
        if value is not None
        for arg in (flag, str(value))
    ]
    try:
        proc = start_daemon(socket_path, model, tuple(passed))
    except InsecureSocket as exc:  # a folder made since the connect, or unsafe in a new way
        _fail(ExitCode.USAGE, str(exc), as_json, code="insecure_socket")
    bar = StagedProgress("starting daemon", progress_mode(as_json))
    try:
        wait_until_ready(socket_path, proc, start_timeout, on_status=lambda s: show_load(bar, s))
    except DaemonUnavailable as exc:
        bar.close(done=False)
        _fail(ExitCode.DAEMON_UNAVAILABLE, str(exc), as_json, code="daemon_unavailable")
    bar.close()
    client = Client(socket_path, timeout=timeout)
    client.connect()
    return client


def show_load(bar: StagedProgress, status: dict[str, Any] | None) -> None:
    """Draw a starting daemon's load progress from its status `load` field."""
    load = (status or {}).get("load")
    if load:
        bar.update(load["stage"], float(load.get("done") or 0), load.get("total"), load["unit"])
    elif status is None:
        bar.update("waiting for the daemon", 0, None, "steps")


def _print_event(event: Event, as_json: bool) -> None:
    if isinstance(event, TokenEvent):
        if as_json:
            click.echo(
                json.dumps(
                    {
                        "type": "token",
                        "index": event.index,
                        "ids": event.ids,
                        "text": event.text,
                        "channel": event.channel,
                    }
                )
            )
        else:
            # A model's reasoning goes to stderr: stdout holds the answer alone.
            out = sys.stderr if event.channel == Channel.REASONING.value else sys.stdout
            out.write(event.text)
            out.flush()
    elif isinstance(event, TelemetryEvent):
        if as_json:
            click.echo(json.dumps({"type": "telemetry", **event.data}))
    elif isinstance(event, DoneEvent):
        if as_json:
            click.echo(
                json.dumps(
                    {
                        "type": "done",
                        "finish_reason": event.finish_reason,
                        "usage": event.usage,
                        "timings": event.timings,
                        "telemetry": event.telemetry,
                        # Under --max-active-experts the output is not the model's own.
                        **({"lossy": event.lossy} if event.lossy else {}),
                    }
                )
            )
        else:
            sys.stdout.write("\n")
            click.echo(summary_line(event), err=True)


def summary_line(done: DoneEvent) -> str:
    t, u = done.timings, done.usage
    parts = [
        f"{u.get('completion_tokens', 0)} tokens",
        f"prompt {u.get('prompt_tokens', 0)}",
        f"ttft {t.get('ttft_s', 0) * 1000:.0f} ms",
        f"decode {t.get('decode_tps', 0):.1f} tok/s",
        f"finish {done.finish_reason}",
    ]
    experts = (done.telemetry or {}).get("experts")
    if experts:
        hits, misses = experts.get("hits", 0), experts.get("misses", 0)
        if hits + misses:
            parts.append(f"expert hits {hits / (hits + misses):.1%}")
        elif not experts.get("bytes_read"):  # every layer routed on the device: nothing looked up
            parts.append("experts all in memory")
        parts.append(f"read {format_bytes(experts.get('bytes_read', 0))}")
        if "stall_s" in experts:
            parts.append(f"stall {experts['stall_s'] * 1000:.0f} ms")
    if done.lossy:
        lossy = done.lossy
        parts.append(
            f"LOSSY: {lossy['active_experts']} of {lossy['native_experts']} experts a token"
        )
    return "[moe] " + " · ".join(parts)
