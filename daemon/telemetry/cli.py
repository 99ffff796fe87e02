"""`moed trace ...`: read router traces recorded with `moe run --trace` or `serve.trace_dir`."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import click


@click.group("trace")
def trace() -> None:
    """Router traces: analyse what the expert cache did and could do."""


@trace.command("analyze")
@click.argument(
    "files", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path)
)
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Folder for the PNG plots (default: <first trace>-analysis/ beside it).",
)
@click.option(
    "--sizes",
    help="Cache sizes to simulate, in slots per layer, comma-separated (default: a grid).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON instead of tables.")
@click.option("--no-plots", is_flag=True, help="Tables only.")
def analyze_cmd(
    files: tuple[Path, ...], out_dir: Path | None, sizes: str | None, as_json: bool, no_plots: bool
) -> None:
    """Distinct experts, popularity, reuse and hit rate vs cache size (every registered eviction
    policy, Belady's optimum)."""
    # the analysis (numpy, matplotlib) on use: every `moed` command imports this module
    from moed.daemon.telemetry.analyze import analyze, default_sizes, format_report
    from moed.daemon.telemetry.analyze_plots import write_plots
    from moed.daemon.telemetry.trace import TraceFormatError, read_trace

    # Checked before the simulation, and by name, so a broken import inside moed is not reported
    # as a missing optional dependency.
    if not no_plots and importlib.util.find_spec("matplotlib") is None:
        raise click.ClickException(
            "plots need matplotlib: pip install 'moed[plots]' (or pass --no-plots)"
        )
    traces = []
    for f in files:
        try:
            traces.append(read_trace(f))
        except (TraceFormatError, ValueError, KeyError) as exc:
            raise click.ClickException(f"{f}: {exc}") from None
        click.echo(
            f"read {f}: {traces[-1].tokens} token rows, {len(traces[-1].passes)} passes", err=True
        )
    grid = [int(s) for s in sizes.split(",")] if sizes else None
    h = traces[0].header
    n_sizes = (
        len(grid)
        if grid
        else len(
            default_sizes(
                int(max(h["experts"])), int(min(h.get("slots_per_layer") or h["experts"]))
            )
        )
    )
    with click.progressbar(
        length=int(h["layers"]) * n_sizes,
        label="simulating caches",
        file=click.get_text_stream("stderr"),
    ) as bar:
        try:
            report = analyze(traces, [str(f) for f in files], grid, progress=bar.update)
        except ValueError as exc:
            raise click.ClickException(str(exc)) from None
    if as_json:
        click.echo(json.dumps(report.to_json(), indent=1))
    else:
        click.echo(format_report(report))
    if not no_plots:
        out = out_dir or files[0].with_name(files[0].stem + "-analysis")
        paths = write_plots(report, out)
        click.echo(f"plots: {', '.join(str(p) for p in paths)}", err=True)
