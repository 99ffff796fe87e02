"""`moed bench stream`: expert streaming against resident mlx-lm, measured side by side in one run.

Writes a generated 4-bit checkpoint with the expert shapes of Qwen3.6-35B-A3B (hidden 2048,
expert width 512, 256 experts, top-8; only a few layers so it runs anywhere), then for the
resident model and each cache budget: decode tokens/s, expert read bandwidth against raw parallel
`pread` of the same files with the page cache dropped, bytes read per token against misses x
expert size, hit rate against Belady's offline optimum on the same routing trace, and where the
time of a token goes.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import click
import numpy as np

from moed.daemon.bench.bench_model import _same_config, bench_config, write_bench_model
from moed.daemon.bench.k_reduction import k_lines, native_agreement
from moed.daemon.bench.reads import raw_pread_bandwidth, sweep, sweep_report
from moed.daemon.bench.recall import decode_steps, lookahead_lines, routing_recall
from moed.daemon.bench.stream_contenders import (
    _prompt,
    default_landing,
    load_resident,
    load_streaming,
    measure,
)
from moed.daemon.bench.stream_report import paired_speed, report
from moed.daemon.experts.prefetch import default_workers
from moed.protocol.model_config import ModelConfig

SWEEP_BURST = 2  # experts per burst in the read sweep: a layer's misses in a decode step at 25%


@click.command("stream")
@click.option("--layers", default=4, show_default=True, help="MoE layers of the generated model")
@click.option("--tokens", default=48, show_default=True, help="decode tokens measured per run")
@click.option(
    "--warmup",
    default=16,
    show_default=True,
    help="tokens generated first (another prompt) to warm the cache",
)
@click.option(
    "--budgets", default="25%,50%,100%", show_default=True, help="comma-separated cache budgets"
)
@click.option(
    "--prefetch-workers",
    default=0,
    show_default=True,
    help="read workers (0: sized to the machine)",
)
@click.option(
    "--page-cache",
    type=click.Choice(["bypass", "trust", "auto"]),
    default="bypass",
    show_default=True,
    help="Bypass or trust the OS page cache while measuring.",
)
@click.option(
    "--dtype",
    type=click.Choice(["auto", "bfloat16", "float16", "float32"]),
    default="auto",
    show_default=True,
    help=(
        "scales/biases and non-expert weights; auto: bfloat16 on Metal, float32 on the CPU "
        "(bf16 is ~9x slower there)"
    ),
)
@click.option("--hidden", default=2048, show_default=True, help="Hidden size of the model.")
@click.option(
    "--expert-width", default=512, show_default=True, help="Intermediate size of one expert."
)
@click.option("--experts", default=256, show_default=True, help="Routed experts per layer.")
@click.option("--top-k", default=8, show_default=True, help="Experts each token is routed to.")
@click.option("--vocab", default=8192, show_default=True, help="Vocabulary size of the model.")
@click.option(
    "--model-dir",
    type=click.Path(path_type=Path),
    default=None,
    help="write (or reuse) the generated model here; default: a temporary directory, removed after",
)
@click.option(
    "--raw-sample-mb",
    default=512,
    show_default=True,
    help="bytes read by the raw pread measurement",
)
@click.option(
    "--spec-budgets",
    default="25%",
    show_default=True,
    help="budgets also run with speculative next-layer prefetch (prefetch_next); empty: none",
)
@click.option(
    "--look-budgets",
    default="",
    show_default=True,
    help="budgets also run with idle-disk lookahead (experts/lookahead.py), reported beside the "
    "same budget without it with the predictor's recall per layer; empty: none",
)
@click.option(
    "--active-experts",
    default="4,6",
    show_default=True,
    help="K values also run with --max-active-experts K (lossy) at the first budget; those at "
    "or above the model's top-k are skipped; empty: none",
)
@click.option(
    "--preloaded/--no-preloaded",
    default=True,
    show_default=True,
    help="also run 100% with every expert preloaded (the machinery's own overhead, no cold misses)",
)
@click.option(
    "--json",
    "json_out",
    type=click.Path(path_type=Path),
    default=None,
    help="also write the results as JSON",
)
@click.option(
    "--model",
    "model_path",
    type=click.Path(path_type=Path, exists=True, file_okay=False),
    default=None,
    help="measure this existing checkpoint (read only, e.g. daemon/model/demo_model or a "
    "`moed bench replica` folder) instead of the generated one; the shape options are then "
    "ignored",
)
@click.option(
    "--sweep",
    "sweep_reads",
    is_flag=True,
    help="also measure the read path for every worker count x chunk size "
    "(how the defaults were chosen)",
)
@click.option(
    "--staged-budgets",
    default="",
    show_default=True,
    help="budgets also run with the STAGED landing (reads into a host staging ring, one device "
    "scatter per burst: experts/landing.py; the default on CUDA); empty: none",
)
@click.option(
    "--direct-budgets",
    default="",
    show_default=True,
    help="budgets also run with the DIRECT landing (reads into the slots' own bytes; the default "
    "off CUDA); empty: none",
)
@click.option(
    "--late-budgets",
    default="",
    show_default=True,
    help="budgets also run without submitting each streamed layer's output to the device once "
    "built (launch_early off: it waits for the next read-back; the default on the CPU); "
    "empty: none",
)
@click.option("--seed", default=0, show_default=True, help="Seed for the weights and prompts.")
def stream(
    layers,
    tokens,
    warmup,
    budgets,
    prefetch_workers,
    page_cache,
    dtype,
    hidden,
    expert_width,
    experts,
    top_k,
    vocab,
    model_dir,
    raw_sample_mb,
    spec_budgets,
    look_budgets,
    active_experts,
    preloaded,
    json_out,
    sweep_reads,
    model_path,
    staged_budgets,
    direct_budgets,
    late_budgets,
    seed,
) -> None:
    """Expert streaming vs resident mlx-lm on a model with Qwen3.6-35B-A3B expert shapes."""
    if dtype == "auto":
        # mlx-lm (with transformers) on use: every `moed` command imports the bench modules
        import mlx.core as mx

        dtype = "bfloat16" if mx.metal.is_available() else "float32"
    config = bench_config(layers, hidden, expert_width, experts, top_k, vocab, bits=4, group=64)
    if model_path is not None:  # an existing model: its own shapes, never written to
        try:
            read = ModelConfig.read(model_path)
        except (OSError, ValueError) as exc:
            raise click.BadParameter(
                f"no readable config.json: {exc}", param_hint="--model"
            ) from None
        if not read.is_moe:
            raise click.BadParameter("not a Mixture-of-Experts model", param_hint="--model")
        config = dict(read.raw)  # text_config nested or not (qwen3_5_moe: the replica's)
        layers, hidden, vocab = read.num_layers, read.hidden_size, read.vocab_size
        experts, top_k = read.num_experts, read.experts_per_token
        expert_width = read.int_of("moe_intermediate_size")
        dtype = read.torch_dtype or dtype
    cleanup = model_dir is None and model_path is None
    path = model_path or (
        Path(model_dir) if model_dir else Path(tempfile.mkdtemp(prefix="moed-bench-stream-"))
    )
    try:
        existing = path / "config.json"
        if model_path is None and not (existing.exists() and _same_config(existing, config, dtype)):
            click.echo(f"writing the benchmark model to {path} ...", err=True)
            t0 = time.perf_counter()
            write_bench_model(path, config, dtype, seed)
            click.echo(f"  written in {time.perf_counter() - t0:.1f} s", err=True)
        workers = prefetch_workers or default_workers()
        warm_prompt, prompt = _prompt(seed + 1, vocab), _prompt(seed + 2, vocab)

        files = sorted(path.glob("model*.safetensors"))
        click.echo("raw parallel pread ...", err=True)
        raw_before = raw_pread_bandwidth(path, workers, raw_sample_mb * 10**6, seed)
        swept = None
        if sweep_reads:
            click.echo("read path sweep ...", err=True)
            swept = sweep(path, SWEEP_BURST, raw_sample_mb * 10**6 // 8, seed)
        click.echo("loading the resident model and one streaming model per budget ...", err=True)
        contenders = [load_resident(path)]
        try:
            for budget in [b.strip() for b in budgets.split(",") if b.strip()]:
                contenders.append(load_streaming(path, budget, workers, page_cache))
            for budget in [b.strip() for b in spec_budgets.split(",") if b.strip()]:
                contenders.append(
                    load_streaming(path, budget, workers, page_cache, speculative=True)
                )
            for budget in [b.strip() for b in look_budgets.split(",") if b.strip()]:
                contenders.append(load_streaming(path, budget, workers, page_cache, lookahead=True))
            for landing, listed in (("staged", staged_budgets), ("direct", direct_budgets)):
                for budget in [b.strip() for b in listed.split(",") if b.strip()]:
                    contenders.append(
                        load_streaming(path, budget, workers, page_cache, landing=landing)
                    )
            for budget in [b.strip() for b in late_budgets.split(",") if b.strip()]:
                contenders.append(
                    load_streaming(path, budget, workers, page_cache, launch_early=False)
                )
            budget_list = [b.strip() for b in budgets.split(",") if b.strip()]
            ks = [int(k) for k in active_experts.split(",") if k.strip()]
            for k in [k for k in ks if 0 < k < top_k and budget_list]:
                contenders.append(
                    load_streaming(path, budget_list[0], workers, page_cache, active_experts=k)
                )
            if preloaded:
                contenders.append(
                    load_streaming(path, "100%", workers, page_cache, preload_all=True)
                )
                # The same, every layer still read back to the host: the serial floor's
                # compute and syncs (stream_report.floor_tok_s).
                for early in (None, False) if late_budgets.strip() else (None,):
                    contenders.append(
                        load_streaming(
                            path,
                            "100%",
                            workers,
                            page_cache,
                            preload_all=True,
                            host_routed=True,
                            launch_early=early,
                        )
                    )
            click.echo(
                "decoding, interleaved token by token: "
                f"{', '.join(c.name for c in contenders)} ...",
                err=True,
            )
            mid_sample = max(1, raw_sample_mb * 10**6 // 8)
            raw_mid: list[float] = []

            def sample_raw(i: int) -> None:
                raw_mid.append(raw_pread_bandwidth(path, workers, mid_sample, seed + 2 + i)["mb_s"])

            measure(contenders, files, warm_prompt, prompt, warmup, tokens, sample_raw)
            resident, *runs = [c.result() for c in contenders]
            for c, run in zip(contenders[1:], runs):  # routing-only predictors, same tokens
                if run.lookahead and c.streamer is not None and c.streamer.trace:
                    steps = decode_steps(c.streamer.trace, top_k)
                    run.lookahead["routing"] = routing_recall(steps, experts, top_k)
            k_rows = [
                (
                    run,
                    int(c.name.rsplit("K=", 1)[1]),
                    native_agreement(c.model, prompt, resident.tokens),
                )
                for c, run in zip(contenders[1:], runs)
                if ",K=" in c.name
            ]
        finally:
            for c in contenders:
                c.close()
            del contenders
        click.echo("raw parallel pread again ...", err=True)
        raw_after = raw_pread_bandwidth(path, workers, raw_sample_mb * 10**6, seed + 1)
        raw = dict(raw_after)
        # The reference: the median of the samples taken among the tokens (before and after
        # when the decode was too short for any).
        raw["mb_s"] = (
            float(np.median(raw_mid)) if raw_mid else (raw_before["mb_s"] + raw_after["mb_s"]) / 2
        )
        raw["bytes"] = raw_before["bytes"] + raw_after["bytes"]
        raw["reads"] = raw_before["reads"] + raw_after["reads"]
        raw["before_mb_s"], raw["after_mb_s"] = raw_before["mb_s"], raw_after["mb_s"]
        raw["between_mb_s"] = raw_mid

        expert_bytes = runs[0].expert_bytes if runs else 0
        meta = {
            "layers": layers,
            "experts": experts,
            "top_k": top_k,
            "hidden": hidden,
            "width": expert_width,
            "bits": (config.get("quantization") or {}).get(
                "bits", 32 if dtype == "float32" else 16
            ),
            "dtype": dtype,
            "expert_bytes": expert_bytes,
            "experts_bytes": expert_bytes * experts * layers,
            "tokens": tokens,
            "warmup": warmup,
            "page_cache": page_cache,
            "landing": default_landing(),
        }
        if swept is not None:
            click.echo(sweep_report(swept, raw["mb_s"], SWEEP_BURST) + "\n")
        native_row = (
            next((r for r in runs if r.name == budget_list[0]), None) if budget_list else None
        )
        click.echo(
            report(meta, raw, resident, runs)
            + "\n".join(["", *k_lines(k_rows, native_row, top_k)])
            + "\n".join(["", *lookahead_lines(runs)])
        )
        if json_out:
            json_out.write_text(
                json.dumps(
                    {
                        "meta": meta,
                        "raw": raw,
                        "resident": asdict(resident),
                        "runs": [
                            {**asdict(r), "x_resident": paired_speed(r, resident)} for r in runs
                        ],
                    },
                    indent=2,
                    default=list,
                )
            )
    finally:
        if cleanup:
            shutil.rmtree(path, ignore_errors=True)
