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
import random
import shutil
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import click
import numpy as np

from moed.client.progress import Progress, progress_mode
from moed.daemon.bench.bench_model import _same_config, bench_config, write_bench_model
from moed.daemon.bench.reads import raw_pread_bandwidth, sweep, sweep_report
from moed.daemon.bench.stream_report import RunResult, paired_speed, report
from moed.daemon.telemetry.analyze import simulate_layers

SWEEP_BURST = 2  # experts per burst in the read sweep: a layer's misses in a decode step at 25%
# Raw pread is also sampled between decode rounds: on a shared machine (or a VM whose disk sits in
# the host's cache) the device's bandwidth drifts, and only samples taken among the tokens see the
# conditions the streaming reads saw.
RAW_EVERY = 4  # decode rounds between two raw samples
PROMPT_TOKENS = 8  # short prompts: a prefill chunk fits the smallest budget in one pass


def _prompt(seed: int, vocab: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(3, vocab) for _ in range(PROMPT_TOKENS)]


class Contender:
    """One model under test (resident or streaming), stepped one decode token at a time so that
    every contender sees the same machine conditions (the runs are interleaved token by token)."""

    def __init__(
        self, name: str, model, streamer=None, preloaded: bool = False, simulate: bool = True
    ):
        self.name, self.model, self.streamer, self.preloaded = name, model, streamer, preloaded
        self.simulate = simulate  # the cache simulations start empty and know no prefetching
        self.tokens: list[int] = []
        self.token_s: list[float] = []
        self.first: dict | None = None

    def warm_up(self, prompt: list[int], n: int) -> None:
        import mlx.core as mx
        from mlx_lm.generate import generate_step

        for _ in generate_step(mx.array(prompt), self.model, max_tokens=n):
            pass

    def start(self, prompt: list[int], n: int) -> None:
        import mlx.core as mx
        from mlx_lm.generate import generate_step

        self._gen = generate_step(mx.array(prompt), self.model, max_tokens=n)
        tok, _ = next(self._gen)  # prefill + first token: not part of the decode measurement
        self._sync()
        self.tokens.append(int(tok))
        if self.streamer is not None:
            self.first = self.streamer.snapshot()

    def step(self) -> bool:
        t0 = time.perf_counter()
        try:
            tok, _ = next(self._gen)
        except StopIteration:
            return False
        self._sync()  # include the token mlx-lm evaluates asynchronously ahead of this one
        self.token_s.append(time.perf_counter() - t0)
        self.tokens.append(int(tok))
        return True

    @staticmethod
    def _sync() -> None:
        import mlx.core as mx
        from mlx_lm.generate import generation_stream

        mx.synchronize(generation_stream)

    def result(self) -> RunResult:
        res = RunResult(
            self.name,
            tokens=self.tokens,
            decode_tokens=len(self.token_s),
            decode_s=sum(self.token_s),
            token_s=self.token_s,
        )
        if self.streamer is None:
            return res
        from moed.daemon.experts import CUMULATIVE_KEYS

        end = self.streamer.snapshot()
        res.counters = {k: end[k] - self.first[k] for k in CUMULATIVE_KEYS}
        res.slots = min(self.streamer.slots)
        res.speculation = {
            k: end[k]
            for k in (
                "prefetch_next_active",
                "prefetch_accuracy",
                "prefetch_net_ms_per_step",
                "overlap_reads_active",
                "overlap_net_ms_per_step",
            )
        }
        res.hits_total, res.misses_total, res.expert_bytes = (
            end["hits"],
            end["misses"],
            end["expert_bytes"],
        )
        if self.simulate:
            trace = [[set(layer.tolist()) for layer in call] for call in self.streamer.trace]
            res.policy = self.streamer.cfg.cache_policy
            res.policy_sim = simulate_layers(trace, res.slots, res.policy)
            res.belady = simulate_layers(trace, res.slots, "belady")
        return res

    def close(self) -> None:
        if self.streamer is not None:
            self.streamer.close()


def load_resident(path: Path) -> Contender:
    from mlx_lm.utils import load_model

    model, _ = load_model(path)
    return Contender("resident", model)


def load_streaming(
    path: Path,
    budget: str,
    workers: int,
    page_cache: str,
    preload_all: bool = False,
    speculative: bool = False,
) -> Contender:
    import mlx.core as mx
    from mlx_lm.utils import load_model

    from moed.daemon.config import PageCachePolicy
    from moed.daemon.experts import StreamingConfig, install_streaming

    model, _ = load_model(path, lazy=True)
    streamer = install_streaming(
        model,
        path,
        StreamingConfig(
            cache_budget=budget,
            prefetch_workers=workers,
            page_cache=PageCachePolicy(page_cache),
            prefetch_next=speculative,
        ),
    )
    mx.eval(model.parameters())
    if preload_all:
        streamer.preload([list(range(n)) for n in streamer.layout.num_experts])
    simulate = not (preload_all or speculative)
    # The simulations replay the routing trace, which needs the choices on the host: a traced
    # run never routes on the device, so the preloaded run (no simulation) goes untraced.
    streamer.trace = [] if simulate else None
    name = budget + ("+pre" if preload_all else "") + ("+spec" if speculative else "")
    return Contender(name, model, streamer, preloaded=preload_all, simulate=simulate)


def measure(
    contenders: list[Contender],
    files: list[Path],
    warm_prompt,
    prompt,
    warmup: int,
    tokens: int,
    between=None,
) -> None:
    """Warm up, then decode every contender one token at a time in turn (a round: one token each,
    in an order rotating by round); `between(i)` runs every RAW_EVERY rounds, outside every
    contender's timing."""
    from moed.daemon.experts.store import drop_page_cache

    drop_page_cache(files)
    for c in contenders:
        c.warm_up(warm_prompt, warmup)
    for c in contenders:
        c.start(prompt, tokens)
    active = list(contenders)
    # A bar on a terminal only (outside each contender's own timing); stdout keeps the report.
    total = tokens * len(contenders)
    with Progress("bench stream: decode", progress_mode(False), total=total) as bar:
        done = rounds = 0
        while active:
            done += len(active)
            # The order rotates round by round, so no contender always runs right after another.
            turn = rounds % len(active)
            order = active[turn:] + active[:turn]
            stepped = {id(c) for c in order if c.step()}
            active = [c for c in active if id(c) in stepped]
            bar.update(min(done, total))
            rounds += 1
            if between is not None and active and rounds % RAW_EVERY == 0:
                between(rounds // RAW_EVERY)


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
    help="measure this existing checkpoint (read only, e.g. daemon/model/demo_model) instead of "
    "the generated one; the shape options are then ignored",
)
@click.option(
    "--sweep",
    "sweep_reads",
    is_flag=True,
    help="also measure the read path for every worker count x chunk size "
    "(how the defaults were chosen)",
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
    preloaded,
    json_out,
    sweep_reads,
    model_path,
    seed,
) -> None:
    """Expert streaming vs resident mlx-lm on a model with Qwen3.6-35B-A3B expert shapes."""
    from moed.daemon.experts.prefetch import default_workers

    if dtype == "auto":
        import mlx.core as mx

        dtype = "bfloat16" if mx.metal.is_available() else "float32"
    config = bench_config(layers, hidden, expert_width, experts, top_k, vocab, bits=4, group=64)
    if model_path is not None:  # an existing model: its own shapes, never written to
        config = json.loads((model_path / "config.json").read_text())
        layers, hidden, vocab = (
            config[k] for k in ("num_hidden_layers", "hidden_size", "vocab_size")
        )
        experts, top_k = config["num_experts"], config["num_experts_per_tok"]
        expert_width = config["moe_intermediate_size"]
        dtype = config.get("torch_dtype", dtype)
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
            if preloaded:
                contenders.append(
                    load_streaming(path, "100%", workers, page_cache, preload_all=True)
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
        }
        if swept is not None:
            click.echo(sweep_report(swept, raw["mb_s"], SWEEP_BURST) + "\n")
        click.echo(report(meta, raw, resident, runs))
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
