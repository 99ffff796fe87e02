"""`moed bench serve`: decode speed and time to first token through daemon + client, and through
the HTTP gateway with the openai SDK, against in-process mlx-lm on the same model, measured side by
side (interleaved runs, the order rotating) in one process tree.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, cast

import click

from moed.client import Client, DaemonUnavailable, TokenEvent
from moed.client.autostart import start_daemon, wait_until_ready
from moed.client.progress import Progress, progress_mode
from moed.daemon.bench.engine_timing import InProcessCore
from moed.daemon.bench.gateway_timing import (
    cpu_seconds,
    openai_client,
    start_gateway,
    thread_cpu_seconds,
    time_through_gateway,
)
from moed.daemon.bench.run_timing import RunTiming, decode_tps
from moed.daemon.model.source import resolve_model


def time_in_process(model, tokenizer, prompt_ids: list[int], max_tokens: int) -> RunTiming:
    """mlx-lm's own streaming loop (tokens and text), as a script using mlx-lm directly runs it."""
    # mlx-lm (with transformers) on use: every `moed` command imports the bench modules
    from mlx_lm import stream_generate

    t0 = time.perf_counter()
    stamps, tokens = [], []
    for response in stream_generate(model, tokenizer, prompt_ids, max_tokens=max_tokens):
        if (
            response.finish_reason == "stop"
        ):  # the EOS token: the daemon sends no token event for it
            break
        stamps.append(time.perf_counter())
        tokens.append(int(response.token))
    return RunTiming(stamps[0] - t0, decode_tps(stamps), tokens)


def time_through_daemon(client, prompt_ids: list[int], max_tokens: int) -> RunTiming:
    cpu0 = time.thread_time()
    t0 = time.perf_counter()
    stamps, tokens, parts = [], [], []
    for event in client.generate(
        prompt_ids=prompt_ids, max_tokens=max_tokens, telemetry_every=1 << 30
    ):
        if isinstance(event, TokenEvent):
            parts.append(event.text)
            if event.ids:
                stamps.append(time.perf_counter())
                tokens.extend(event.ids)
    cpu = time.thread_time() - cpu0
    return RunTiming(stamps[0] - t0, decode_tps(stamps), tokens, "".join(parts), cpu)


@click.command("serve")
@click.option("--model", default="demo", show_default=True, help="Model folder, HF id or 'demo'.")
@click.option("--max-tokens", default=128, show_default=True, help="Tokens generated per run.")
@click.option("--runs", default=5, show_default=True, help="Alternating runs of each side.")
@click.option(
    "--prompt", default="def fibonacci(n):", show_default=True, help="The measured prompt."
)
@click.option(
    "--engine-core",
    is_flag=True,
    help="Also time the daemon's engine core in this process, with no socket (a second copy of "
    "the model: for small models): the engine's share of the gap, apart from the hops'.",
)
def bench_serve(model: str, max_tokens: int, runs: int, prompt: str, engine_core: bool) -> None:
    """Daemon + client and gateway + openai SDK vs in-process mlx-lm: decode tok/s ratios and
    extra time to first token."""
    # mlx-lm (with transformers) on use: every `moed` command imports the bench modules
    from mlx_lm import load

    path = resolve_model(model)
    click.echo(f"model {path}  max_tokens {max_tokens}  runs {runs} (alternating)", err=True)
    mlx_model, tokenizer = cast("tuple[Any, Any]", load(str(path)))  # typed 2- or 3-tuple
    prompt_ids = list(tokenizer.encode(prompt))
    sock_dir = Path(tempfile.mkdtemp(prefix="moed-bench-", dir="/tmp"))
    socket = sock_dir / "s.sock"
    # Its own state and log dirs: a benchmark leaves no trace in the user's daemon.log or profile.
    daemon = start_daemon(
        socket,
        str(path),
        ("--state-dir", str(sock_dir / "state"), "--resident", "--log-level", "WARNING"),
        env={"MOED_LOG_DIR": str(sock_dir / "logs")},
    )
    try:
        try:
            wait_until_ready(socket, daemon, 300)
        except DaemonUnavailable as exc:
            raise click.ClickException(str(exc)) from None
        client = Client(socket, timeout=10.0)
        gateway, url = start_gateway(socket, sock_dir / "gateway.log")
        oai = openai_client(url)
        served = client.connect()["model"]["name"]
        # Warm every side (graph caches, allocator, HTTP connection) before timing.
        time_in_process(mlx_model, tokenizer, prompt_ids, 8)
        time_through_daemon(client, prompt_ids, 8)
        time_through_gateway(oai, served, prompt_ids, 8)
        local, remote, http, cores = [], [], [], []
        core = None
        if engine_core:
            core = InProcessCore(path, sock_dir / "core-state")
            core.time(prompt_ids, 8)
        # A bar on a terminal only: the report on stdout stays clean for BENCHMARKS.md.
        with Progress("bench serve: runs", progress_mode(False), total=runs) as bar:
            sides = [
                lambda: local.append(time_in_process(mlx_model, tokenizer, prompt_ids, max_tokens)),
                lambda: remote.append(time_through_daemon(client, prompt_ids, max_tokens)),
                lambda: http.append(time_through_gateway(oai, served, prompt_ids, max_tokens)),
            ]
            if core is not None:
                sides.append(lambda: cores.append(core.time(prompt_ids, max_tokens)))
            gateway_cpu = -cpu_seconds(gateway.pid)
            transport_cpu = -thread_cpu_seconds(daemon.pid, daemon.pid)
            for i in range(runs):
                # Rotate the order run by run: no side always follows the same one (MLX's
                # threads in this process may still spin for a moment after an in-process run).
                for k in range(len(sides)):
                    sides[(i + k) % len(sides)]()
                bar.update(i + 1)
            gateway_cpu += cpu_seconds(gateway.pid)
            transport_cpu += thread_cpu_seconds(daemon.pid, daemon.pid)
        if core is not None:
            core.close()
        same = all(r.tokens == local[0].tokens for r in local + remote + cores)
        same_text = all(h.text == remote[0].text for h in http)
        gateway.terminate()
        gateway.wait(15)
        client.shutdown("bench done")
        client.close()
        daemon.wait(30)
    finally:
        if "gateway" in locals() and gateway.poll() is None:
            gateway.kill()
        if daemon.poll() is None:
            daemon.kill()
        shutil.rmtree(sock_dir, ignore_errors=True)
    l_tps = statistics.median(r.decode_tps for r in local)
    r_tps = statistics.median(r.decode_tps for r in remote)
    l_ttft = statistics.median(r.ttft_s for r in local)
    r_ttft = statistics.median(r.ttft_s for r in remote)
    h_tps = statistics.median(h.decode_tps for h in http)
    h_ttft = statistics.median(h.ttft_s for h in http)
    click.echo(
        f"{'':24}{'in-process mlx-lm':>20}{'daemon + client':>20}{'ratio / delta':>16}"
        f"{'gateway + openai':>20}{'ratio / delta':>16}"
    )
    click.echo(
        f"{'decode tok/s (median)':24}{l_tps:20.1f}{r_tps:20.1f}{r_tps / l_tps:16.3f}"
        f"{h_tps:20.1f}{h_tps / l_tps:16.3f}"
    )
    click.echo(
        f"{'time to first token':24}{l_ttft * 1000:18.2f}ms{r_ttft * 1000:18.2f}ms"
        f"{(r_ttft - l_ttft) * 1000:+14.2f}ms"
        f"{h_ttft * 1000:18.2f}ms{(h_ttft - l_ttft) * 1000:+14.2f}ms"
    )
    gateway_tokens = sum(h.tokens for h in http)
    # Every token of both remote sides crosses the daemon's transport thread.
    hop_tokens = max(gateway_tokens + sum(len(r.tokens) for r in remote), 1)
    client_tokens = max(sum(len(r.tokens) for r in remote), 1)
    click.echo(
        f"CPU per token: gateway process {gateway_cpu / max(gateway_tokens, 1) * 1e6:.0f} us "
        f"({gateway_tokens} tokens streamed through it), daemon transport thread "
        f"{transport_cpu / hop_tokens * 1e6:.0f} us, client library "
        f"{sum(r.cpu_s for r in remote) / client_tokens * 1e6:.0f} us"
    )
    if cores:
        c_tps = statistics.median(r.decode_tps for r in cores)
        c_ttft = statistics.median(r.ttft_s for r in cores)
        click.echo(
            f"engine core in this process (no socket): decode {c_tps:.1f} tok/s, "
            f"ratio {c_tps / l_tps:.3f}, time to first token {(c_ttft - l_ttft) * 1000:+.2f}ms"
        )
    click.echo(
        f"identical tokens: {same}   gateway text identical: {same_text}   "
        f"(machine: {os.cpu_count()} cpus, {sys.platform})"
    )
