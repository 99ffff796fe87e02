"""`moed bench prewarm`: does pre-loading the experts a previous trace found hot pay off?

Three ways to start a generation, measured side by side in one run, each on a freshly loaded
streaming model with the same expert-cache budget:

- cold: empty expert cache, the checkpoint's pages dropped from the OS page cache;
- warm page cache: empty expert cache, every checkpoint page in the page cache (a restart soon
  after the last one);
- prewarm: pages dropped, then each layer's most used experts in the trace read into the cache
  (through the daemon's own start-up warming path) before the clock starts; the preload time is
  reported beside it.

The trace comes from `--trace FILE` (e.g. `moe run --trace`), or is recorded here on a different
prompt than the measured one, so prewarming is not shown the answer. Tokens must be identical in
every scenario (streaming is exact); the command says so.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import click
import numpy as np

from moed.client.progress import Progress, progress_mode
from moed.daemon.bench.serve import time_in_process
from moed.daemon.experts import profile as profile_mod
from moed.daemon.experts.store import drop_page_cache
from moed.daemon.model.source import ModelNotFound, resolve_model
from moed.daemon.telemetry.residency import PageCacheProbe
from moed.daemon.telemetry.trace import (
    TraceRecorder,
    parse_trace,
    read_trace,
    record_steps,
    trace_header,
)
from moed.protocol.units import format_bytes

SCENARIOS = ("cold", "warm page cache", "prewarm")


@dataclass
class Run:
    scenario: str
    ttft_s: float
    decode_tps: float
    tokens: list[int]
    hit_rate: float
    bytes_read: int
    stall_s: float
    preload_s: float = 0.0
    preload_bytes: int = 0
    page_cache_before: float | None = (
        None  # share of the experts' pages cached when the clock started
    )


@dataclass
class Summary:
    scenario: str
    runs: list[Run] = field(default_factory=list)

    def median(self, name: str) -> float:
        return statistics.median(getattr(r, name) for r in self.runs)


def checkpoint_files(path: Path) -> list[Path]:
    return sorted(Path(path).glob("*.safetensors"))


def fill_page_cache(path: Path) -> None:
    for f in checkpoint_files(path):
        with open(f, "rb") as fh:
            while fh.read(16 << 20):
                pass


def experts_cached_share(streamer) -> float | None:
    """Share of the experts' pages in the page cache (mincore), sampled over every expert."""
    probe = PageCacheProbe()
    try:
        fractions = []
        for pool in streamer.pools:
            for t in pool.tensors:
                f = probe.resident_fraction(
                    t.loc.file, t.loc.offset, t.loc.expert_stride * pool.num_experts
                )
                if f is None:
                    return None
                fractions.append(f)
        return float(np.mean(fractions)) if fractions else None
    finally:
        probe.close()


def hot_counts(traces, layers: int, experts: list[int]) -> list[np.ndarray]:
    """Per layer, how many token rows chose each expert across the traces."""
    counts = [np.zeros(e, dtype=np.int64) for e in experts]
    for t in traces:
        if t.layers != layers:
            raise click.ClickException(
                f"the trace has {t.layers} MoE layers; the model has {layers}"
            )
        for layer in range(layers):
            rows = t.token_rows(layer).reshape(-1)
            counts[layer] += np.bincount(rows, minlength=experts[layer])[: experts[layer]]
    return counts


def _load(model_path: Path, budget: str, page_cache: str, state_dir: Path | None):
    # mlx-lm (and transformers under it) on use: every `moed` command imports this module
    import mlx.core as mx
    from mlx_lm.utils import load

    # mlx-lm (with transformers) on use: every `moed` command imports the bench modules
    from moed.daemon.experts import PageCachePolicy, StreamingConfig, install_streaming

    model, tokenizer = cast("tuple[Any, Any]", load(str(model_path), lazy=True))  # 2 or 3
    streamer = install_streaming(
        model,
        model_path,
        StreamingConfig(
            cache_budget=budget, page_cache=PageCachePolicy(page_cache), state_dir=state_dir
        ),
    )
    mx.eval(model.parameters())
    return model, tokenizer, streamer


def record_trace(
    model_path: Path, budget: str, page_cache: str, prompt_ids: list[int], max_tokens: int
):
    """A trace of one generation on a fresh model (what `moe run --trace` records)."""
    import io

    # mlx-lm (with transformers) on use: every `moed` command imports the bench modules
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    model, _tok, streamer = _load(model_path, budget, page_cache, None)
    buf = io.BytesIO()
    try:
        rec = TraceRecorder(
            streamer,
            trace_header(
                streamer,
                {"name": model_path.name, "path": str(model_path)},
                {"id": "bench-prewarm", "prompt_tokens": len(prompt_ids)},
            ),
            buf.write,
        )
        record_steps(
            rec, generate_step(mx.array(prompt_ids, dtype=mx.uint32), model, max_tokens=max_tokens)
        )
    finally:
        streamer.close()
    return buf.getvalue(), parse_trace(io.BytesIO(buf.getvalue()))


def measure(
    model_path: Path,
    scenario: str,
    budget: str,
    page_cache: str,
    prompt_ids: list[int],
    max_tokens: int,
    counts: list[np.ndarray],
) -> Run:
    with tempfile.TemporaryDirectory(prefix="moed-prewarm-") as tmp:
        state_dir = Path(tmp) if scenario == "prewarm" else None
        if (
            state_dir is not None
        ):  # the hot experts as a usage profile: the daemon's warm() reads it
            profile_mod.save_profile(
                profile_mod.profile_path(state_dir, model_path), model_path, counts
            )
        model, tokenizer, streamer = _load(model_path, budget, page_cache, state_dir)
        try:
            if scenario == "warm page cache":
                fill_page_cache(model_path)
            else:
                drop_page_cache(checkpoint_files(model_path))
            preload_s: float = 0
            preload_bytes = 0
            if scenario == "prewarm":
                t0 = time.perf_counter()
                preload_bytes = streamer.warm()
                preload_s = time.perf_counter() - t0
            cached = experts_cached_share(streamer)
            before = streamer.snapshot()
            timing = time_in_process(model, tokenizer, prompt_ids, max_tokens)
            after = streamer.snapshot()
        finally:
            streamer.close()
    hits, misses = after["hits"] - before["hits"], after["misses"] - before["misses"]
    return Run(
        scenario,
        timing.ttft_s,
        timing.decode_tps,
        timing.tokens,
        hits / (hits + misses) if hits + misses else 0.0,
        after["bytes_read"] - before["bytes_read"],
        after["stall_s"] - before["stall_s"],
        preload_s,
        int(preload_bytes),
        cached,
    )


def _encode(tokenizer_path: Path, text: str) -> list[int]:
    # mlx-lm (with transformers) on use: every `moed` command imports the bench modules
    from mlx_lm.utils import load_tokenizer

    return list(load_tokenizer(tokenizer_path).encode(text))


@click.command("prewarm")
@click.option("--model", default="demo", show_default=True, help="Model folder, HF id or 'demo'.")
@click.option(
    "--trace",
    "trace_files",
    multiple=True,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Trace(s) whose hot experts to preload (default: record one on --trace-prompt).",
)
@click.option(
    "--cache-budget",
    "budget",
    default="25%",
    show_default=True,
    help="Expert cache budget for every scenario.",
)
@click.option(
    "--page-cache",
    type=click.Choice(["auto", "bypass", "trust"]),
    default="auto",
    show_default=True,
    help="Bypass or trust the OS page cache while measuring.",
)
@click.option(
    "--prompt", default="def quicksort(items):", show_default=True, help="The measured prompt."
)
@click.option(
    "--trace-prompt",
    default="import os\n\ndef walk(path):",
    show_default=True,
    help="Prompt of the trace recorded when no --trace is given.",
)
@click.option("--max-tokens", default=64, show_default=True, help="Tokens generated per run.")
@click.option(
    "--runs",
    default=3,
    show_default=True,
    help="Rounds; each round runs every scenario, order rotated.",
)
@click.option(
    "--save-trace",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Keep the recorded trace here.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the runs as JSON.")
def prewarm(
    model,
    trace_files,
    budget,
    page_cache,
    prompt,
    trace_prompt,
    max_tokens,
    runs,
    save_trace,
    as_json,
) -> None:
    """Pre-load a trace's hot experts vs a cold start vs a warm page cache: TTFT and decode
    tok/s."""
    import json

    try:
        path = resolve_model(model)
    except ModelNotFound as exc:
        raise click.ClickException(str(exc)) from None
    say = lambda msg: click.echo(f"[prewarm] {msg}", err=True)  # noqa: E731
    prompt_ids = _encode(path, prompt)
    if trace_files:
        traces = [read_trace(f) for f in trace_files]
        say(f"hot experts from {len(traces)} trace(s): {sum(t.tokens for t in traces)} token rows")
    else:
        say(f"recording a trace of {max_tokens} tokens on a different prompt ({trace_prompt!r})")
        data, trace = record_trace(
            path, budget, page_cache, _encode(path, trace_prompt), max_tokens
        )
        traces = [trace]
        if save_trace:
            save_trace.write_bytes(data)
            say(f"trace saved to {save_trace}")
    h = traces[0].header
    counts = hot_counts(traces, int(h["layers"]), list(h["experts"]))
    summaries = {s: Summary(s) for s in SCENARIOS}
    total = runs * len(SCENARIOS)
    n = 0
    bar = Progress("bench prewarm: runs", progress_mode(False), total=total)  # terminals only
    for r in range(runs):
        order = SCENARIOS[r % 3 :] + SCENARIOS[: r % 3]  # rotate so no scenario always goes first
        for scenario in order:
            n += 1
            run = measure(path, scenario, budget, page_cache, prompt_ids, max_tokens, counts)
            summaries[scenario].runs.append(run)
            bar.update(n)
            say(
                f"run {n}/{total} {scenario:<16} ttft {run.ttft_s * 1000:8.1f} ms  "
                f"decode {run.decode_tps:7.1f} tok/s  "
                f"hit {run.hit_rate:6.1%}  read {format_bytes(run.bytes_read):>9}"
                + (f"  preload {run.preload_s * 1000:.0f} ms" if scenario == "prewarm" else "")
            )
    bar.close()
    reference = summaries["cold"].runs[0].tokens
    identical = all(r.tokens == reference for s in summaries.values() for r in s.runs)
    if as_json:
        click.echo(
            json.dumps(
                {
                    "model": str(path),
                    "budget": budget,
                    "max_tokens": max_tokens,
                    "runs": runs,
                    "identical_tokens": identical,
                    "scenarios": {
                        s: [{k: v for k, v in vars(r).items() if k != "tokens"} for r in summ.runs]
                        for s, summ in summaries.items()
                    },
                },
                indent=1,
            )
        )
        return
    click.echo(format_table(summaries, path, budget, max_tokens, runs, identical))


def format_table(
    summaries: dict[str, Summary],
    path: Path,
    budget: str,
    max_tokens: int,
    runs: int,
    identical: bool,
) -> str:
    cold = summaries["cold"]
    lines = [
        f"model {path.name}  budget {budget}  {max_tokens} tokens  "
        f"median of {runs} run(s) per scenario",
        f"{'':18}{'TTFT ms':>10}{'vs cold':>9}{'decode tok/s':>14}{'vs cold':>9}{'hit rate':>10}"
        f"{'read MB':>9}{'stall ms':>10}{'preload ms':>12}{'pages cached':>14}",
    ]
    for name, s in summaries.items():
        cached = [r.page_cache_before for r in s.runs if r.page_cache_before is not None]
        lines.append(
            f"{name:<18}{s.median('ttft_s') * 1000:>10.1f}"
            f"{s.median('ttft_s') / cold.median('ttft_s'):>8.2f}x"
            f"{s.median('decode_tps'):>14.1f}"
            f"{s.median('decode_tps') / max(cold.median('decode_tps'), 1e-9):>8.2f}x"
            f"{s.median('hit_rate'):>10.1%}{s.median('bytes_read') / 1e6:>9.1f}"
            f"{s.median('stall_s') * 1000:>10.1f}"
            f"{s.median('preload_s') * 1000:>12.0f}"
            f"{(f'{statistics.median(cached):.0%}' if cached else '-'):>14}"
        )
    lines.append(
        f"identical tokens in every run: {identical}   "
        f"(machine: {os.cpu_count()} cpus, {sys.platform})"
    )
    return "\n".join(lines)
