"""`moed bench switch`: what a switch between models costs a request, beside a request to the
model already loaded. One daemon serves two models under a shared budget sized to hold one of
them (their footprints, planned as the daemon plans them), so a request naming the other model
waits for the loaded one's unload, its own load, its prompt and its first token. Rounds of
A A B B: each model's first request is a switch, its second a request to a loaded model, both
timed from the client's side through the real client library, in the same run.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import click

from moed.client import Client
from moed.daemon.bench.batch import PROMPTS, Side, _show_logs, _start, _stop
from moed.daemon.bench.batch_clients import ClientJob, StreamRecord, run_clients
from moed.daemon.config import ServeConfig
from moed.daemon.model.source import resolve_model
from moed.protocol.units import format_bytes

NAMES = ("first", "second")  # the two models' names in the bench's [models]: one folder may be both
PROMPT = PROMPTS[0]
# Every request reads its whole prompt: a prefix cache would make a repeated prompt cheaper on
# the loaded side than after a switch, which is not the cost measured here.
NO_PREFIX_CACHE = {"prefix_cache_bytes": "0", "prefix_cache_disk_bytes": "0"}


@dataclass(frozen=True)
class Timing:
    """One request as its client saw it."""

    model: str
    switch: bool  # the other model was loaded when it was sent
    ttft_ms: float
    total_ms: float
    decode_tps: float  # tokens after the first over their span
    tokens: list[int]

    @classmethod
    def of(cls, model: str, switch: bool, rec: StreamRecord) -> Timing:
        if not rec.stamps:
            raise click.ClickException(f"a request to {model} received no token")
        span = rec.stamps[-1] - rec.stamps[0]
        return cls(
            model,
            switch,
            (rec.stamps[0] - rec.sent) * 1000,
            (rec.stamps[-1] - rec.sent) * 1000,
            (len(rec.stamps) - 1) / span if span > 0 else 0.0,
            list(rec.tokens),
        )


def _serve_settings(cache_budget: str) -> ServeConfig:
    """The settings both models run under (written to the bench's config as [serve])."""
    if cache_budget == "resident":
        return ServeConfig(resident=True, **NO_PREFIX_CACHE)  # type: ignore[arg-type]
    return ServeConfig(cache_budget=cache_budget, **NO_PREFIX_CACHE)  # type: ignore[arg-type]


def _write_config(path: Path, paths: list[Path], capacity: int, cache_budget: str) -> None:
    lines = ["[serve]", f'models_memory_bytes = "{capacity}"']
    lines += [f'{k} = "{v}"' for k, v in NO_PREFIX_CACHE.items()]
    if cache_budget != "resident":
        lines.append(f'cache_budget = "{cache_budget}"')
    lines += ["", "[models]"]
    lines += [f"{name} = {json.dumps(str(p))}" for name, p in zip(NAMES, paths)]
    path.write_text("\n".join(lines) + "\n")


def _loaded(socket: Path) -> list[str]:
    with Client(socket, timeout=30.0) as c:
        return [m["name"] for m in c.models()["loaded"]]


def _request(socket: Path, model: str, max_tokens: int) -> StreamRecord:
    return run_clients(socket, [ClientJob(PROMPT, max_tokens=max_tokens, model=model)])[0]


def _rounds(socket: Path, rounds: int, max_tokens: int) -> list[Timing]:
    """A A B B per round: a switch to each model, then a request to it loaded. After every
    switch the listing must show the other model gone: else the run measured no switch."""
    timings = []
    for _ in range(rounds):
        for name in NAMES:
            timings.append(Timing.of(name, True, _request(socket, name, max_tokens)))
            loaded = _loaded(socket)
            if loaded != [name]:
                raise click.ClickException(
                    f"after a request to {name} the loaded models are {loaded}: the budget did "
                    "not force a switch (see the footprints above)"
                )
            timings.append(Timing.of(name, False, _request(socket, name, max_tokens)))
    return timings


def _median(timings: list[Timing], switch: bool, field: str) -> float:
    return statistics.median(getattr(t, field) for t in timings if t.switch is switch)


def _report(timings: list[Timing], references: dict[str, list[int]], max_tokens: int) -> dict:
    rows = {}
    for field, label in (
        ("ttft_ms", "time to first token (ms)"),
        ("total_ms", f"whole request, {max_tokens} tokens (ms)"),
        ("decode_tps", "decode tok/s after the first"),
    ):
        loaded, switch = _median(timings, False, field), _median(timings, True, field)
        rows[field] = {
            "label": label,
            "loaded": round(loaded, 3),
            "switch": round(switch, 3),
            "ratio": round(switch / loaded, 3) if loaded else None,
        }
    same = sum(t.tokens == references[t.model] for t in timings)
    return {"rows": rows, "identical": same, "requests": len(timings)}


def _print(report: dict, header: str, footer: list[str]) -> None:
    click.echo(header)
    click.echo(f"{'':36}{'loaded':>12}{'switch':>12}{'switch/loaded':>15}")
    for row in report["rows"].values():
        ratio = "-" if row["ratio"] is None else f"{row['ratio']:.2f}"
        click.echo(f"{row['label']:36}{row['loaded']:>12.1f}{row['switch']:>12.1f}{ratio:>15}")
    for line in footer:
        click.echo(line)


@click.command("switch")
@click.option(
    "--models",
    default="demo,demo",
    show_default=True,
    help="Two models (folders, HF ids or 'demo'); one given twice is two models, each its own "
    "engine and memory.",
)
@click.option("--max-tokens", default=32, show_default=True, help="Tokens per request.")
@click.option("--rounds", default=5, show_default=True, help="Rounds of A A B B.")
@click.option(
    "--cache-budget",
    default="100%",
    show_default=True,
    help="Each model's expert cache budget (a size or a percentage), or 'resident'.",
)
@click.option(
    "--json", "json_out", type=click.Path(dir_okay=False, path_type=Path), help="Write results."
)
def bench_switch(
    models: str, max_tokens: int, rounds: int, cache_budget: str, json_out: Path | None
) -> None:
    """The cost of a switch (the loaded model unloaded, the other loaded, its first token)
    beside a request to a loaded model: time to first token, whole request, their ratio."""
    specs = [m.strip() for m in models.split(",") if m.strip()]
    if len(specs) != 2:
        raise click.BadParameter("two models, comma-separated", param_hint="--models")
    if cache_budget == "auto":
        raise click.BadParameter(
            "auto sizes the cache to the shared budget; give a size or a percentage",
            param_hint="--cache-budget",
        )
    if rounds < 1 or max_tokens < 1:
        raise click.BadParameter("rounds and max tokens must be >= 1")
    # mlx-lm (with transformers) on use: every `moed` command imports the bench modules
    from moed.daemon.model.footprint import model_footprint

    paths = [resolve_model(spec) for spec in specs]
    serve = _serve_settings(cache_budget)
    # Planned as the daemon plans them (a fixed budget does not depend on the capacity given).
    sizes = [model_footprint(serve, p, 1 << 40) for p in paths]
    capacity = max(sizes) + min(sizes) // 2  # either one fits, never both
    run_dir = Path(tempfile.mkdtemp(prefix="moed-bench-", dir="/tmp"))
    config = run_dir / "moed.toml"
    _write_config(config, paths, capacity, cache_budget)
    side = Side(cache_budget, run_dir / "s.sock")
    click.echo(
        f"models {NAMES[0]}={paths[0]} {NAMES[1]}={paths[1]}  footprints "
        f"{format_bytes(sizes[0])}, {format_bytes(sizes[1])}  shared budget "
        f"{format_bytes(capacity)}  {rounds} rounds",
        err=True,
    )
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    procs: list = []
    try:
        procs = _start([side], NAMES[0], run_dir, ("--config", str(config)))
        # Untimed: each model loaded once and answered (the references), then back to the first.
        references = {name: _request(side.socket, name, max_tokens).tokens for name in NAMES}
        _request(side.socket, NAMES[0], 4)
        timings = _rounds(side.socket, rounds, max_tokens)
        _stop([side], procs)
    except click.ClickException:
        raise
    except BaseException:
        _show_logs(run_dir)
        raise
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        shutil.rmtree(run_dir, ignore_errors=True)

    report = _report(timings, references, max_tokens)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    switches = sum(t.switch for t in timings)
    _print(
        report,
        f"moed bench switch: {paths[0].name} <-> {paths[1].name}, {max_tokens} greedy tokens per "
        f"request, medians of {switches} switches and {len(timings) - switches} requests to the "
        f"loaded model ({rounds} rounds of A A B B, one daemon, cache budget {cache_budget})",
        [
            "switch: the other model unloaded, this one loaded, its prompt read, its first token "
            f"(shared budget {format_bytes(capacity)}: one model at a time)",
            f"answers identical to the model's first answer: {report['identical']}/"
            f"{report['requests']}",
            f"(machine: {os.cpu_count()} cpus, {sys.platform}"
            + (f", load average {load_before:.1f} -> {load:.1f})" if load is not None else ")"),
        ],
    )
    if json_out:
        json_out.write_text(
            json.dumps(
                {
                    "models": {name: str(p) for name, p in zip(NAMES, paths)},
                    "footprints": dict(zip(NAMES, sizes)),
                    "capacity_bytes": capacity,
                    "max_tokens": max_tokens,
                    "rounds": rounds,
                    "cache_budget": cache_budget,
                    **report,
                    "references": references,
                    "requests_timed": [asdict(t) for t in timings],
                    "machine": {"cpus": os.cpu_count(), "load_average": [load_before, load]},
                },
                indent=2,
            )
        )
