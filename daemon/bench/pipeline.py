"""`moed bench pipeline`: one process against a 2-rank pipeline on this machine, both streaming
the same model at the same per-rank budget, through real daemons, measured side by side: one
client at a time, then several clients at once (one batch, one forward through the ranks per
step)."""

from __future__ import annotations

import shutil
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path

import click

from moed.client import Client, DaemonUnavailable
from moed.client.autostart import start_daemon, wait_until_ready
from moed.daemon.bench.batch import PROMPTS
from moed.daemon.bench.batch_clients import ClientJob, run_clients, summarize
from moed.daemon.bench.serve import time_through_daemon
from moed.daemon.model.source import resolve_model
from moed.protocol.units import format_bytes


@dataclass(frozen=True)
class SetupResult:
    ranks: int
    decode_tps: float
    tokens: list[int]
    memory: list[dict]  # per rank: rss, resident weights, expert slots
    link: dict | None  # bytes moved between ranks over the timed runs
    batch_tps: float | None  # concurrent clients: every client's tokens / wall time (median)
    batch_tokens: list[list[int]]  # each client's tokens in the first concurrent run


def _rank_memory(status: dict) -> list[dict]:
    if status.get("ranks"):
        return [
            {
                "rss": r["rss_bytes"],
                "weights": r["resident_weight_bytes"],
                "experts": r.get("experts", {}).get("resident_bytes", 0),
                "layers": r["layers"],
            }
            for r in status["ranks"]
        ]
    streaming = status.get("streaming") or {}
    return [
        {
            "rss": status.get("rss_bytes", 0),
            "weights": streaming.get("resident_weight_bytes", 0),
            "experts": streaming.get("resident_bytes", 0),
            "layers": [0, (status.get("model") or {}).get("num_layers")],
        }
    ]


def _link(status: dict) -> dict | None:
    ranks = status.get("ranks")
    return ranks[0]["link"] if ranks else None


class Setup:
    """A daemon of `ranks` ranks on its own socket, state and log dirs."""

    def __init__(self, path: Path, ranks: int, budget: str):
        self.ranks = ranks
        self.tmp = Path(tempfile.mkdtemp(prefix="moed-bench-", dir="/tmp"))
        self.socket = self.tmp / "s.sock"
        args = ["--state-dir", str(self.tmp / "state"), "--cache-budget", budget]
        # Concurrent clients sent together start as one batch, on both sides alike.
        args += ["--log-level", "WARNING", "--batch-window-ms", "300"]
        if ranks > 1:
            args += ["--pipeline", str(ranks)]
        env = {"MOED_LOG_DIR": str(self.tmp / "logs")}
        self.daemon = start_daemon(self.socket, str(path), tuple(args), env=env)
        self.client: Client | None = None  # once connected
        self.timed: list = []
        self.batched: list = []  # StreamRecord lists, one per concurrent run

    def connect(self) -> None:
        try:
            wait_until_ready(self.socket, self.daemon, 300)
        except DaemonUnavailable as exc:
            raise click.ClickException(str(exc)) from None
        self.client = Client(self.socket, timeout=30.0)

    def connected(self) -> Client:
        assert self.client is not None, "connect first"
        return self.client

    def close(self) -> None:
        try:
            if self.client is not None:
                self.client.shutdown("bench done")
                self.client.close()
                self.daemon.wait(60)
        finally:
            if self.daemon.poll() is None:
                self.daemon.kill()
            shutil.rmtree(self.tmp, ignore_errors=True)

    def result(self, link_before: dict | None) -> SetupResult:
        status = self.connected().status()  # each request's `done` refreshed every rank's counters
        link = _link(status)
        if link is not None and link_before is not None:
            moved = (link["activation_bytes"] + link["broadcast_bytes"]) - (
                link_before["activation_bytes"] + link_before["broadcast_bytes"]
            )
            tokens = link["forward_tokens"] - link_before["forward_tokens"]
            link = {
                "bytes_per_token": moved / max(1, tokens),
                "steps": link["steps"] - link_before["steps"],
            }
        return SetupResult(
            self.ranks,
            statistics.median(t.decode_tps for t in self.timed),
            self.timed[0].tokens,
            _rank_memory(status),
            link,
            statistics.median(summarize(r).total_tps for r in self.batched)
            if self.batched
            else None,
            [rec.tokens for rec in self.batched[0]] if self.batched else [],
        )


_mb = format_bytes  # the one byte formatter


@click.command("pipeline")
@click.option("--model", default="demo", show_default=True, help="Model folder, HF id or 'demo'.")
@click.option("--budget", default="25%", show_default=True, help="Expert cache budget per rank.")
@click.option(
    "--ranks", type=click.IntRange(min=2), default=2, show_default=True, help="Pipeline ranks."
)
@click.option("--max-tokens", default=64, show_default=True, help="Tokens generated per run.")
@click.option("--runs", default=3, show_default=True, help="Timed runs of each setup.")
@click.option(
    "--clients",
    type=click.IntRange(min=0, max=len(PROMPTS)),
    default=3,
    show_default=True,
    help="Concurrent clients of the batched runs (0: none).",
)
# A prompt the demo model continues for well over 64 tokens (no early end of text).
@click.option(
    "--prompt",
    default="import os\nimport sys\n\nclass",
    show_default=True,
    help="The measured prompt.",
)
def pipeline(
    model: str, budget: str, ranks: int, max_tokens: int, runs: int, clients: int, prompt: str
) -> None:
    """1 process vs N local ranks (ring over loopback): tok/s of one client and of concurrent
    clients, memory per rank, bytes per token."""
    # mlx-lm (with transformers) on use: every `moed` command imports the bench modules
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    path = resolve_model(model)
    prompt_ids = list(load_tokenizer(path).encode(prompt))
    click.echo(
        f"model {path}  budget {budget} per rank  {max_tokens} tokens x {runs} runs", err=True
    )
    # Both daemons run at once and the runs alternate, so machine noise hits both sides alike.
    setups = [Setup(path, 1, budget), Setup(path, ranks, budget)]
    try:
        for s in setups:
            s.connect()  # then warm graph caches and the expert cache
            time_through_daemon(s.connected(), prompt_ids, 8)
        before = [_link(s.connected().status()) for s in setups]
        jobs = [ClientJob(PROMPTS[i], max_tokens=max_tokens) for i in range(clients)]
        for _ in range(runs):
            for s in setups:
                s.timed.append(time_through_daemon(s.connected(), prompt_ids, max_tokens))
                if jobs:
                    s.batched.append(run_clients(s.socket, jobs))
        one, two = (s.result(b) for s, b in zip(setups, before))
    finally:
        for s in setups:
            s.close()
    click.echo(f"{'':34}{'1 process':>16}{f'{ranks} ranks':>16}{'ratio':>10}")
    click.echo(
        f"{'decode tok/s (median)':34}{one.decode_tps:16.1f}{two.decode_tps:16.1f}"
        f"{two.decode_tps / one.decode_tps:10.3f}"
    )
    if one.batch_tps is not None and two.batch_tps is not None:
        click.echo(
            f"{f'{clients} clients: total tok/s (median)':34}{one.batch_tps:16.1f}"
            f"{two.batch_tps:16.1f}{two.batch_tps / one.batch_tps:10.3f}"
        )
    for what in ("weights", "experts", "rss"):
        per_rank = [m[what] for m in two.memory]
        label = {"weights": "resident weights", "experts": "expert cache", "rss": "process RSS"}
        click.echo(
            f"{label[what] + ' per rank (max)':34}{_mb(one.memory[0][what]):>16}"
            f"{_mb(max(per_rank)):>16}{max(per_rank) / max(1, one.memory[0][what]):10.3f}"
        )
    layers = ", ".join(f"rank {i}: {m['layers']}" for i, m in enumerate(two.memory))
    click.echo(f"layers: {layers}")
    if two.link:
        click.echo(
            f"bytes between ranks per token: {two.link['bytes_per_token']:.0f} "
            f"(activations + step broadcasts, {two.link['steps']} steps)"
        )
    click.echo(f"tokens per run: {len(one.tokens)}   identical tokens: {one.tokens == two.tokens}")
    if clients:
        same = one.batch_tokens == two.batch_tokens
        click.echo(f"{clients} clients in one batch: identical tokens per client: {same}")
