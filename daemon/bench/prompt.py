"""`moed bench prompt`: a long prompt read under expert streaming at several chunk sizes, side by
side in one run: bytes read per prompt token, reads per distinct expert of each chunk (at most
one: a chunk reads each expert once), and prompt tokens per second, with ratios to the smallest
chunk. `plan` is the chunk the daemon takes for a prompt read alone (engine/chunk_budget.py)."""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from contextlib import nullcontext
from dataclasses import dataclass, replace
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
    resident_seconds: float | None = None  # the resident model, same chunks, same run
    same: bool | None = None  # the first token's log-probabilities bit-identical to resident's

    def per_token(self, prompt_tokens: int) -> float:
        return self.bytes_read / prompt_tokens


def _first_token(model, prompt: list[int], chunk: int, unused_output=nullcontext):
    """(seconds, log-probabilities) of the first token, read as the daemon reads a prompt alone:
    the engine's batch (mlx-lm's BatchGenerator) in chunks of `chunk` tokens, with the scope it
    enters around each step."""
    # mlx on use: every `moed` command imports the bench modules
    import mlx.core as mx

    # mlx-lm (the engine's batch is its BatchGenerator) on use, as above
    from moed.daemon.engine.batch import DecodeBatch
    from moed.daemon.engine.sampling import greedy

    batch = DecodeBatch(model, [], max_batch=1, prefill_chunk=chunk, unused_output=unused_output)
    t0 = time.perf_counter()
    batch.insert(prompt, 1, greedy)
    logprobs = None
    while batch.rows:
        for tok in batch.step().tokens:
            logprobs = tok.logprobs
    assert logprobs is not None  # one token was asked for
    mx.eval(logprobs)
    seconds = time.perf_counter() - t0
    batch.close()
    return seconds, logprobs


def _read_prompt(
    path: Path, config: ModelConfig, budget: str, page_cache: str, prompt, chunk: int, plan
):
    """A fresh streaming model (a cold cache) reads the prompt in chunks of `chunk` tokens;
    returns the run and the first token's log-probabilities."""
    # mlx-lm (with transformers) on use: every `moed` command imports the bench modules
    import mlx.core as mx
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
        streamer.record_routing()
        before = streamer.snapshot()
        seconds, logprobs = _first_token(model, prompt, chunk, streamer.steps.unused_output)
        after = streamer.snapshot()
        distinct = sum(len(layer) for step in streamer.trace for layer in step)
        run = PromptRun(
            chunk,
            "",
            seconds,
            after["bytes_read"] - before["bytes_read"],
            after["misses"] - before["misses"],
            distinct,
            len(streamer.trace),
        )
        return run, logprobs
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
        f"{'reads/distinct':>14} {'prompt tok/s':>12} {'x speed':>8} {'x resident':>10} "
        f"{'same':>5}",
    ]
    for r in runs:
        name = f"{r.chunk}{' (' + r.label + ')' if r.label else ''}"
        speed = prompt_tokens / r.seconds
        vs = f"{r.resident_seconds / r.seconds:>10.2f}" if r.resident_seconds else f"{'-':>10}"
        same = "-" if r.same is None else ("yes" if r.same else "NO")
        lines.append(
            f"{name:>12} {r.steps:>6} {r.bytes_read / 1e6:>9.1f} "
            f"{r.per_token(prompt_tokens) / 1e3:>13.1f} "
            f"{r.bytes_read / max(1, base.bytes_read):>8.3f} "
            f"{r.reads / max(1, r.distinct):>14.3f} {speed:>12.1f} "
            f"{speed / (prompt_tokens / base.seconds):>8.2f} {vs} {same:>5}"
        )
    lines.append(
        "x resident: the resident model's time for the same chunks over the streamed one's; same:"
        " the first token's log-probabilities bit-identical to resident's"
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
@click.option(
    "--resident/--no-resident",
    default=True,
    show_default=True,
    help="also read the prompt on the resident model (every weight in memory), same chunks",
)
def prompt_bench(
    layers, hidden, expert_width, experts, top_k, vocab, prompt_tokens, budget, chunks,
    plan_context_tokens, page_cache, model_path, model_dir, json_out, seed, resident,
) -> None:  # fmt: skip
    """Bytes read per prompt token at several prefill chunk sizes, under expert streaming."""
    # mlx-lm (with transformers) on use: every `moed` command imports the bench modules
    import mlx.core as mx
    from mlx_lm.utils import load_model

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
        checkpoint = ModelConfig.read(path)
        vocab_size = checkpoint.vocab_size or vocab
        rng = np.random.default_rng(seed)
        prompt = [int(t) for t in rng.integers(3, vocab_size, size=prompt_tokens)]
        runs, firsts = [], []
        for size in sizes:
            click.echo(f"reading the prompt in chunks of {size or PLAN} ...", err=True)
            run, logprobs = _read_prompt(path, checkpoint, budget, page_cache, prompt, size, plan)
            runs.append(replace(run, label=PLAN if size == 0 else ""))
            firsts.append(logprobs)
        if resident:  # loaded once, after the streamed runs: it never shares their memory
            click.echo("reading the prompt on the resident model ...", err=True)
            model, _ = load_model(path)
            for i, (run, logprobs) in enumerate(zip(runs, firsts)):
                seconds, want = _first_token(model, prompt, run.chunk)
                same = bool(mx.array_equal(logprobs, want).item())
                runs[i] = replace(run, resident_seconds=seconds, same=same)
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
