"""`moed bench batch`: many clients at once through real daemons and the real client library.

One daemon per side (resident and each cache budget) is up for the whole run; every cell (a side
and a number of concurrent clients) runs once per round, the order rotating round by round, so
every column sees the same machine conditions. Reported from the clients' side: total and
per-client tok/s, the gap between tokens, time to first token, total throughput against one
client; a long prompt arriving while streams decode; and how often concurrent greedy streams equal
the same prompt generated alone.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import click

from moed.client import Client, DaemonUnavailable
from moed.client.autostart import start_daemon, wait_until_ready
from moed.client.progress import Progress, progress_mode
from moed.daemon.bench.batch_clients import (
    ClientJob,
    LongPromptResult,
    long_prompt_effect,
    run_clients,
    summarize,
)
from moed.daemon.bench.batch_report import (
    Cell,
    Solo,
    logprob_drift,
    long_row,
    print_clients,
    print_exactness,
    print_long,
)
from moed.daemon.model.source import resolve_model

# One prompt per client (code and prose, the demo model's material); client i sends PROMPTS[i].
PROMPTS = (
    "def fibonacci(n):",
    "import os\nimport sys\n\ndef main():",
    "class Stack:\n    def __init__(self):",
    "# Read a CSV file and print the average of each column\n",
    "The quick brown fox",
    "def quicksort(items):",
    "for i in range(10):",
    "Once upon a time, in a small village,",
)
LONG_STREAMS = 3  # streams decoding when the long prompt arrives (the scenario)
LONG_STREAM_TOKENS = 1500  # their cap: they stop at the long prompt's first token
LONG_AFTER = 48  # tokens of every stream before the long prompt is sent (the baseline)


@dataclass(frozen=True)
class Side:
    name: str  # "resident" or a cache budget
    socket: Path

    @property
    def args(self) -> tuple[str, ...]:
        return ("--resident",) if self.name == "resident" else ("--cache-budget", self.name)


def _long_ids(n: int, vocab: int) -> tuple[int, ...]:
    """A deterministic prompt of `n` token ids (special ids below 3 left out)."""
    return tuple((31 * i + 7) % (vocab - 3) + 3 for i in range(n))


def _jobs(clients: int, max_tokens: int) -> list[ClientJob]:
    return [ClientJob(PROMPTS[i], max_tokens=max_tokens) for i in range(clients)]


def _long_jobs(long_ids: tuple[int, ...]) -> list[ClientJob]:
    # The streams decode through the whole read of the long prompt, then stop.
    streams = [
        ClientJob(PROMPTS[i], max_tokens=LONG_STREAM_TOKENS, until_late_token=True)
        for i in range(LONG_STREAMS)
    ]
    return streams + [ClientJob(prompt_ids=long_ids, max_tokens=4, start_after=LONG_AFTER)]


def _start(sides: list[Side], model: str, run_dir: Path, extra: tuple[str, ...]) -> list:
    procs = []
    for side in sides:
        # Its own state and log dirs: a benchmark leaves no trace in the user's daemon or profile.
        procs.append(
            start_daemon(
                side.socket,
                model,
                (
                    "--state-dir",
                    str(run_dir / side.name.replace("%", "pct") / "state"),
                    *side.args,
                    "--log-level",
                    "WARNING",
                    *extra,
                ),
                env={"MOED_LOG_DIR": str(run_dir / "logs")},
            )
        )
    for side, proc in zip(sides, procs):
        try:
            wait_until_ready(side.socket, proc, 300)
        except DaemonUnavailable as exc:
            raise click.ClickException(f"{side.name}: {exc}") from None
    return procs


def _stop(sides: list[Side], procs: list) -> None:
    for side, proc in zip(sides, procs):
        if proc.poll() is None:
            try:
                with Client(side.socket, timeout=10.0) as c:
                    c.shutdown("bench done")
                proc.wait(30)
            except Exception:
                proc.kill()
                proc.wait(10)


def _rounds(
    sides: list[Side],
    counts: list[int],
    max_tokens: int,
    rounds: int,
    long_ids: tuple[int, ...],
    solos: list[Solo],
) -> tuple[dict[tuple[str, int], Cell], dict[str, list[LongPromptResult]]]:
    """Every cell once per round, the order rotating by a fraction of the cells each round."""
    cells = {(s.name, n): Cell(s.name, n) for s in sides for n in counts}
    longs: dict[str, list[LongPromptResult]] = {s.name: [] for s in sides}
    order: list[tuple[Side, int]] = [(s, n) for s in sides for n in counts]
    if long_ids:
        order += [(s, 0) for s in sides]  # 0 clients: the long-prompt scenario
    with Progress("bench batch: cells", progress_mode(False), total=rounds * len(order)) as bar:
        done = 0
        for r in range(rounds):
            shift = (r * len(order)) // rounds
            for side, n in order[shift:] + order[:shift]:
                if n == 0:
                    recs = run_clients(side.socket, _long_jobs(long_ids))
                    longs[side.name].append(long_prompt_effect(recs[:-1], recs[-1]))
                else:
                    recs = run_clients(side.socket, _jobs(n, max_tokens))
                    cells[(side.name, n)].add(summarize(recs), recs, solos)
                done += 1
                bar.update(done)
    return cells, longs


def _show_logs(run_dir: Path) -> None:
    for log in sorted(run_dir.rglob("*.log")):
        lines = log.read_text(errors="replace").splitlines()[-20:]
        click.echo(f"--- {log.relative_to(run_dir)} (last lines)\n" + "\n".join(lines), err=True)


def _csv(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


@click.command("batch")
@click.option("--model", default="demo", show_default=True, help="Model folder, HF id or 'demo'.")
@click.option("--clients", default="1,2,4,8", show_default=True, help="Concurrent clients.")
@click.option(
    "--budgets",
    default="resident,25%,50%",
    show_default=True,
    help="Sides: 'resident' and expert-cache budgets, one daemon each.",
)
@click.option("--max-tokens", default=128, show_default=True, help="Tokens per client.")
@click.option("--rounds", default=3, show_default=True, help="Runs of every cell, order rotating.")
@click.option(
    "--long-prompt",
    default=1900,
    show_default=True,
    help="Tokens of the prompt that arrives while 3 streams decode (0: skip the scenario).",
)
@click.option("--prefill-chunk", type=int, default=None, help="The daemons' prefill chunk.")
@click.option(
    "--json", "json_out", type=click.Path(dir_okay=False, path_type=Path), help="Write results."
)
def bench_batch(
    model: str,
    clients: str,
    budgets: str,
    max_tokens: int,
    rounds: int,
    long_prompt: int,
    prefill_chunk: int | None,
    json_out: Path | None,
) -> None:
    """1, 2, 4, 8 concurrent clients, resident and streaming: total and per-client tok/s, gaps
    between tokens, time to first token, a long prompt among decoding streams, exactness."""
    counts = sorted({int(c) for c in _csv(clients)})
    if not counts or counts[0] < 1 or counts[-1] > len(PROMPTS):
        raise click.BadParameter(f"between 1 and {len(PROMPTS)} clients", param_hint="--clients")
    path = resolve_model(model)
    run_dir = Path(tempfile.mkdtemp(prefix="moed-bench-", dir="/tmp"))
    sides = [Side(name, run_dir / f"s{i}.sock") for i, name in enumerate(_csv(budgets))]
    extra: tuple[str, ...] = ("--max-batch", str(max(counts[-1], LONG_STREAMS + 1)))
    if prefill_chunk:
        extra += ("--prefill-chunk", str(prefill_chunk))
    click.echo(
        f"model {path}  {max_tokens} tokens per client  {rounds} rounds (order rotating)  "
        f"sides {', '.join(s.name for s in sides)}",
        err=True,
    )
    # Other tenants of the machine show in every column: the load average says how many.
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    procs: list = []
    try:
        procs = _start(sides, str(path), run_dir, extra)
        with Client(sides[0].socket, timeout=10.0) as c:
            welcome = c.connect()
        limits = welcome["limits"]
        if limits.get("context_tokens") and long_prompt + 4 > limits["context_tokens"]:
            raise click.BadParameter(
                f"{long_prompt} tokens leave no room in the model's context "
                f"({limits['context_tokens']})",
                param_hint="--long-prompt",
            )
        long_ids = _long_ids(long_prompt, limits["vocab_size"]) if long_prompt else ()
        # The references: each prompt alone (with its top-2 logprobs), on the first side. This
        # also warms that daemon; the others are warmed by the largest batch, untimed.
        solo_jobs = [ClientJob(p, max_tokens=max_tokens, logprobs=2) for p in PROMPTS[: counts[-1]]]
        solos = [Solo.of(run_clients(sides[0].socket, [job])[0]) for job in solo_jobs]
        for side in sides:
            run_clients(side.socket, _jobs(counts[-1], 8))
        cells, longs = _rounds(sides, counts, max_tokens, rounds, long_ids, solos)
        # Untimed: every side's largest batch again, asking for logprobs, to see whether a
        # batch changes any row's numbers at all (not only its argmax).
        drift = {}
        for side in sides:
            jobs = [ClientJob(p, max_tokens=max_tokens, logprobs=2) for p in PROMPTS[: counts[-1]]]
            drift[side.name] = logprob_drift(solos, run_clients(side.socket, jobs))
        _stop(sides, procs)
    except click.ClickException:
        raise
    except BaseException:
        _show_logs(run_dir)  # the run directory goes away with the daemons' logs
        raise
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        shutil.rmtree(run_dir, ignore_errors=True)

    rows = []
    for s in sides:
        base = cells[(s.name, counts[0])].total_tps if counts[0] == 1 else 0.0
        rows += [cells[(s.name, n)].row(base) for n in counts]
    click.echo(
        f"moed bench batch: {path.name}, {max_tokens} greedy tokens per client, median of "
        f"{rounds} rounds per cell (cells interleaved, order rotating); gaps and TTFT pooled"
    )
    print_clients(rows)
    long_rows = [long_row(s.name, longs[s.name]) for s in sides if longs[s.name]]
    if long_rows:
        print_long(long_rows, long_prompt, LONG_STREAMS)
    exact = print_exactness(rows, solos)
    exact["logprob_drift"] = {name: {"max_abs": w, "tokens": n} for name, (w, n) in drift.items()}
    click.echo(
        f"  greedy-token logprobs, {counts[-1]} concurrent streams vs alone (untimed run): max "
        + ", ".join(f"{name} {w:.1e} over {n} tokens" for name, (w, n) in drift.items())
    )
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    click.echo(
        f"(machine: {os.cpu_count()} cpus, {sys.platform}"
        + (
            f", load average {load_before:.1f} at the start, {load:.1f} at the end)"
            if load
            else ")"
        )
    )
    if json_out:
        json_out.write_text(
            json.dumps(
                {
                    "model": str(path),
                    "max_tokens": max_tokens,
                    "rounds": rounds,
                    "clients": counts,
                    "sides": [s.name for s in sides],
                    "cells": rows,
                    "long_prompt": {
                        "tokens": long_prompt,
                        "streams": LONG_STREAMS,
                        "rows": long_rows,
                    },
                    "exactness": exact,
                    "solo": [asdict(s) for s in solos],
                    "machine": {
                        "cpus": os.cpu_count(),
                        "platform": sys.platform,
                        "load_average": [load_before, load],
                    },
                },
                indent=2,
            )
        )
