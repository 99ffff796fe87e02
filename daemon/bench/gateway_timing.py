"""The gateway column of `moed bench serve`: a `moed gateway` process in front of the bench's
daemon, timed through the official openai SDK's streaming completions, as an HTTP tool sees it."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import click


@dataclass(frozen=True)
class GatewayTiming:
    ttft_s: float
    decode_tps: float
    text: str
    tokens: int


def start_gateway(daemon_socket: Path, log_path: Path) -> tuple[subprocess.Popen, str]:
    """A gateway on a free loopback port; returns it and its base URL once /health answers."""
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "moed.daemon.cli", "gateway", "--socket", str(daemon_socket)]
    cmd += ["--port", str(port), "--log-level", "WARNING"]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=log, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise click.ClickException(f"the gateway exited: {log_path.read_text()[-2000:]}")
        try:
            httpx.get(f"{url}/health", timeout=1.0)
            return proc, url
        except httpx.TransportError:
            time.sleep(0.1)
    proc.kill()
    raise click.ClickException("the gateway did not answer within 30s")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (the gateway's cost, independent of load)."""
    import psutil

    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def thread_cpu_seconds(pid: int, tid: int) -> float:
    """User + system CPU time of one thread of a process (the daemon's transport runs on its main
    thread, tid == pid, beside the engine's)."""
    import psutil

    for thread in psutil.Process(pid).threads():
        if thread.id == tid:
            return thread.user_time + thread.system_time
    return 0.0


def openai_client(url: str):
    try:
        import openai
    except ImportError:
        raise click.ClickException(
            "the gateway column streams through the openai package: pip install 'moed[test]'"
        ) from None
    return openai.OpenAI(base_url=f"{url}/v1", api_key="bench", max_retries=0)


def time_through_gateway(oai, model: str, prompt_ids: list[int], max_tokens: int) -> GatewayTiming:
    """Streamed /v1/completions of the same token ids, greedy. Every token with text is one SSE
    chunk; the decode rate counts the usage's tokens over the span of the chunks."""
    t0 = time.perf_counter()
    stamps, parts, tokens = [], [], 0
    stream = oai.completions.create(
        model=model,
        prompt=prompt_ids,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        if chunk.choices and chunk.choices[0].text:
            stamps.append(time.perf_counter())
            parts.append(chunk.choices[0].text)
    span = stamps[-1] - stamps[0] if len(stamps) > 1 else 0.0
    tps = (tokens - 1) / span if span > 0 else 0.0
    return GatewayTiming(stamps[0] - t0, tps, "".join(parts), tokens)
