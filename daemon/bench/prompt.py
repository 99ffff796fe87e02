"""`moed bench prompt`: a long prompt read under expert streaming at several chunk sizes, side by
side in one run: bytes read per prompt token, reads per distinct expert of each chunk (at most
one: a chunk reads each expert once), and prompt tokens per second, with ratios to the smallest
chunk. `plan` is the chunk the daemon takes for a prompt read alone (engine/chunk_budget.py)."""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import click
import numpy as np

from moed.daemon.bench.bench_model import _same_config, bench_config, write_bench_model
from moed.daemon.engine.chunk_budget import chunk_budget
from moed.daemon.experts.store import PageCachePolicy
from moed.protocol.model_config import ModelConfig

PLAN = "plan"
DEFAULT_PREFILL_CHUNK = 256  # ServeConfig's prefill_chunk: the plan's floor


@dataclass(frozen=True)
class PromptRun:
    chunk: int
    label: str
    seconds: float
    bytes_read: int
    reads: int  # experts loaded (misses)
    distinct: int  # distinct experts per layer per forward pass, summed: the most reads allowed
    steps: int  # forward passes (chunks, then the first decode step)

    def per_token(self, prompt_tokens: int) -> float:
        return self.bytes_read / prompt_tokens


def _read_prompt(
    path: Path, config: ModelConfig, budget: str, page_cache: str, prompt, chunk: int, plan
):
    """A fresh streaming model (a cold cache) reads the prompt in chunks of `chunk` tokens."""
    # mlx-lm (with transformers) on use: every `moed` command imports the bench modules
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model

    # mlx-lm (with transformers) on use: every `moed` command imports the bench modules
    from moed.daemon.experts import StreamingConfig, estimate_kv_bytes, install_streaming

    model, _ = load_model(path, lazy=True)
    cfg = StreamingConfig(
        cache_budget=budget,
        page_cache=PageCachePolicy(page_cache),
        kv_bytes=estimate_kv_bytes(config, plan.plan_kv_tokens),
    )
    streamer = install_streaming(model, path, cfg)
    try:
        mx.eval(model.parameters())
        if chunk <= 0:  # the plan's own chunk for this prompt, from this model's memory plan
            chunk = _plan_chunk(config, streamer.plan.working_bytes, plan, len(prompt))
        streamer.trace = []
        before = streamer.snapshot()
        t0 = time.perf_counter()
        for _ in generate_step(mx.array(prompt), model, max_tokens=1, prefill_step_size=chunk):
            pass
        seconds = time.perf_counter() - t0
        after = streamer.snapshot()
        distinct = sum(len(layer) for step in streamer.trace for layer in step)
        return PromptRun(
            chunk,
            "",
            seconds,
            after["bytes_read"] - before["bytes_read"],
            after["misses"] - before["misses"],
            distinct,
            len(streamer.trace),
        )
    finally:
        streamer.close()


@dataclass(frozen=True)
class _Plan:
    plan_kv_tokens: int
    floor: int


def _plan_chunk(config: ModelConfig, working_bytes: int, plan: _Plan, prompt_tokens: int) -> int:
    dtype_bytes = 4 if config.torch_dtype == "float32" else 2
    budget = chunk_budget(config, working_bytes, plan.plan_kv_tokens, plan.floor, dtype_bytes)
    return budget.alone(prompt_tokens + 1, prompt_tokens + 1)


def report(runs: list[PromptRun], prompt_tokens: int, budget: str) -> str:
    base = runs[0]
    lines = [
        f"prompt of {prompt_tokens} tokens, expert cache budget {budget}, a cold cache per run",
        f"{'chunk':>12} {'steps':>6} {'read MB':>9} {'KB/prompt tok':>13} {'x bytes':>8} "
        f"{'reads/distinct':>14} {'prompt tok/s':>12} {'x speed':>8}",
    ]
    for r in runs:
        name = f"{r.chunk}{' (' + r.label + ')' if r.label else ''}"
        speed = prompt_tokens / r.seconds
        lines.append(
            f"{name:>12} {r.steps:>6} {r.bytes_read / 1e6:>9.1f} "
            f"{r.per_token(prompt_tokens) / 1e3:>13.1f} "
            f"{r.bytes_read / max(1, base.bytes_read):>8.3f} "
            f"{r.reads / max(1, r.distinct):>14.3f} {speed:>12.1f} "
            f"{speed / (prompt_tokens / base.seconds):>8.2f}"
        )
    return "\n".join(lines)


@click.command("prompt")
@click.option("--layers", default=2, show_default=True, help="MoE layers of the generated model")
@click.option("--hidden", default=1024, show_default=True, help="Hidden size of the model.")
@click.option("--expert-width", default=256, show_default=True, help="Width of one expert.")
@click.option("--experts", default=256, show_default=True, help="Routed experts per layer.")
@click.option("--top-k", default=8, show_default=True, help="Experts each token is routed to.")
@click.option("--vocab", default=8192, show_default=True, help="Vocabulary size of the model.")
@click.option("--prompt-tokens", default=512, show_default=True, help="Tokens of the prompt.")
@click.option("--budget", default="25%", show_default=True, help="Expert cache budget.")
@click.option(
    "--chunks",
    default="32,128,plan",
    show_default=True,
    help="comma-separated chunk sizes; `plan`: the daemon's chunk for a prompt read alone",
)
@click.option("--plan-context-tokens", default=8192, show_default=True, help="The plan's KV room.")
@click.option(
    "--page-cache",
    type=click.Choice(["bypass", "trust", "auto"]),
    default="bypass",
    show_default=True,
    help="Bypass or trust the OS page cache while measuring.",
)
@click.option(
    "--model",
    "model_path",
    type=click.Path(path_type=Path, exists=True, file_okay=False),
    default=None,
    help="measure this existing checkpoint (read only) instead of the generated one",
)
@click.option(
    "--model-dir",
    type=click.Path(path_type=Path),
    default=None,
    help="write (or reuse) the generated model here; default: a temporary directory",
)
@click.option(
    "--json",
    "json_out",
    type=click.Path(path_type=Path),
    default=None,
    help="also write the results as JSON",
)
@click.option("--seed", default=0, show_default=True, help="Seed for the weights and prompt.")
def prompt_bench(
    layers, hidden, expert_width, experts, top_k, vocab, prompt_tokens, budget, chunks,
    plan_context_tokens, page_cache, model_path, model_dir, json_out, seed,
) -> None:  # fmt: skip
    """Bytes read per prompt token at several prefill chunk sizes, under expert streaming."""
    # mlx-lm (with transformers) on use: every `moed` command imports the bench modules
    import mlx.core as mx

    dtype = "bfloat16" if mx.metal.is_available() else "float32"
    config = bench_config(layers, hidden, expert_width, experts, top_k, vocab, bits=4, group=64)
    if model_path is not None:
        config = json.loads((model_path / "config.json").read_text())
    cleanup = model_dir is None and model_path is None
    path = model_path or (
        Path(model_dir) if model_dir else Path(tempfile.mkdtemp(prefix="moed-bench-prompt-"))
    )
    sizes = [0 if c.strip() == PLAN else int(c) for c in chunks.split(",") if c.strip()]
    plan = _Plan(plan_context_tokens, DEFAULT_PREFILL_CHUNK)
    try:
        existing = path / "config.json"
        if model_path is None and not (existing.exists() and _same_config(existing, config, dtype)):
            click.echo(f"writing the benchmark model to {path} ...", err=True)
            write_bench_model(path, config, dtype, seed)
        config = ModelConfig.read(path)
        vocab_size = config.vocab_size or vocab
        rng = np.random.default_rng(seed)
        prompt = [int(t) for t in rng.integers(3, vocab_size, size=prompt_tokens)]
        runs = []
        for size in sizes:
            click.echo(f"reading the prompt in chunks of {size or PLAN} ...", err=True)
            run = _read_prompt(path, config, budget, page_cache, prompt, size, plan)
            runs.append(PromptRun(**{**run.__dict__, "label": PLAN if size == 0 else ""}))
        click.echo(report(runs, prompt_tokens, budget))
        if json_out:
            rows = [{**r.__dict__, "bytes_per_prompt_token": r.per_token(prompt_tokens)}
                    for r in runs]  # fmt: skip
            json_out.write_text(
                json.dumps({"prompt_tokens": prompt_tokens, "runs": rows}, indent=2)
            )
    finally:
        if cleanup:
            shutil.rmtree(path, ignore_errors=True)
