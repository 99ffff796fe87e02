"""`moed bench format`: what structured output's token masks cost. The same prompts decode with
and without a JSON schema (llguidance's mask on every step of the schema rows), through one real
daemon and the real client, the two sides alternating round by round: decode tok/s of each, their
ratio, and whether plain rows batched beside schema rows kept their tokens.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
from pathlib import Path

import click

from moed.daemon.bench.batch import PROMPTS, Side, _start, _stop
from moed.daemon.bench.batch_clients import ClientJob, StreamRecord, run_clients
from moed.daemon.model.source import resolve_model

# Many required items: the grammar cannot end before max_tokens, so both sides decode as long.
SCHEMA = {
    "type": "array",
    "minItems": 64,
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "count": {"type": "integer"},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        },
        "required": ["name", "count"],
        "additionalProperties": False,
    },
}
FORMAT = {"type": "json_schema", "schema": SCHEMA}


def decode_tps(record: StreamRecord) -> float:
    span = record.stamps[-1] - record.stamps[0] if len(record.stamps) > 1 else 0.0
    return (len(record.stamps) - 1) / span if span > 0 else 0.0


def _jobs(clients: int, max_tokens: int, schema_rows: int) -> list[ClientJob]:
    return [
        ClientJob(PROMPTS[i], max_tokens=max_tokens, format=FORMAT if i < schema_rows else None)
        for i in range(clients)
    ]


@click.command("format")
@click.option("--model", default="demo", show_default=True, help="Model folder, HF id or 'demo'.")
@click.option("--clients", default=1, show_default=True, help="Concurrent streams per run.")
@click.option("--max-tokens", default=200, show_default=True, help="Tokens per stream.")
@click.option("--rounds", default=5, show_default=True, help="Runs of each side, alternating.")
@click.option(
    "--cache-budget", default=None, help="The daemon's expert cache budget (default: resident)."
)
def bench_format(
    model: str, clients: int, max_tokens: int, rounds: int, cache_budget: str | None
) -> None:
    """Decode tok/s with a JSON schema against without, side by side; with --clients N, also a
    mixed batch (half the rows under the schema) whose plain rows must keep their tokens."""
    if not 1 <= clients <= len(PROMPTS):
        raise click.BadParameter(f"must be in 1..{len(PROMPTS)}", param_hint="--clients")
    path = resolve_model(model)
    run_dir = Path(tempfile.mkdtemp(prefix="moed-bench-", dir="/tmp"))
    side = Side(cache_budget or "resident", run_dir / "s.sock")
    click.echo(
        f"model {path}  clients {clients}  max_tokens {max_tokens}  rounds {rounds} "
        f"(alternating)  {side.name}",
        err=True,
    )
    procs = _start([side], str(path), run_dir, ())
    try:
        plain_jobs = _jobs(clients, max_tokens, 0)
        schema_jobs = _jobs(clients, max_tokens, clients)
        mixed_jobs = _jobs(clients, max_tokens, clients // 2)
        run_clients(side.socket, _jobs(clients, 8, 0))  # warm up both paths
        run_clients(side.socket, _jobs(clients, 8, clients))
        plain: list[list[StreamRecord]] = []
        schema: list[list[StreamRecord]] = []
        for i in range(rounds):
            order = [(plain, plain_jobs), (schema, schema_jobs)]
            for runs, jobs in order if i % 2 == 0 else order[::-1]:
                runs.append(run_clients(side.socket, jobs))
        mixed = run_clients(side.socket, mixed_jobs) if clients > 1 else None
    finally:
        _stop([side], procs)
        shutil.rmtree(run_dir, ignore_errors=True)
    p_tps = statistics.median(decode_tps(r) for run in plain for r in run)
    s_tps = statistics.median(decode_tps(r) for run in schema for r in run)
    p_tokens = statistics.median(len(r.tokens) for run in plain for r in run)
    s_tokens = statistics.median(len(r.tokens) for run in schema for r in run)
    click.echo(f"{'':28}{'plain':>12}{'json schema':>14}{'ratio':>10}")
    click.echo(f"{'decode tok/s per stream':28}{p_tps:12.1f}{s_tps:14.1f}{s_tps / p_tps:10.3f}")
    click.echo(f"{'tokens per stream (median)':28}{p_tokens:12.0f}{s_tokens:14.0f}")
    if mixed is not None:
        kept = all(mixed[i].tokens == plain[0][i].tokens for i in range(clients // 2, clients))
        click.echo(
            f"mixed batch ({clients // 2} schema + {clients - clients // 2} plain rows): "
            f"plain rows' tokens identical to the all-plain batch: {kept}"
        )
