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
import os
import random
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import click
import numpy as np

PROMPT_TOKENS = 8  # short prompts: a prefill chunk fits the smallest budget in one pass


# -- the generated checkpoint ----------------------------------------------------------------


def bench_config(
    layers: int,
    hidden: int,
    width: int,
    experts: int,
    top_k: int,
    vocab: int,
    bits: int,
    group: int,
) -> dict:
    heads = max(2, hidden // 128)
    quant = {"group_size": group, "bits": bits}
    for i in range(layers):
        quant[f"model.layers.{i}.mlp.gate"] = {
            "group_size": 64,
            "bits": 8,
        }  # routers stay 8-bit, as mlx-lm converts them
    return {
        "model_type": "qwen3_moe",
        "architectures": ["Qwen3MoeForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": 4 * width,
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // 8),
        "head_dim": 128,
        "num_experts": experts,
        "num_experts_per_tok": top_k,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "moe_intermediate_size": width,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab,
        "rope_theta": 10000000.0,
        "tie_word_embeddings": False,
        "max_position_embeddings": 8192,
        "norm_topk_prob": True,
        "quantization": quant,
        "quantization_config": quant,
    }


def write_bench_model(dest: Path, config: dict, dtype: str, seed: int = 0) -> Path:
    """Non-expert weights from the mlx-lm model class; expert tensors written directly in the
    quantized layout (random packed weights, scales and biases), one shard per layer, so the
    full-precision experts never exist in memory."""
    import mlx.core as mx
    import mlx.nn as nn
    import numpy as np
    from mlx.utils import tree_flatten
    from mlx_lm.models import qwen3_moe

    dest.mkdir(parents=True, exist_ok=True)
    mx.random.seed(seed)
    rng = np.random.default_rng(seed)
    mx_dtype = getattr(mx, dtype)
    quant = config["quantization"]
    bits, group = quant["bits"], quant["group_size"]
    model = qwen3_moe.Model(qwen3_moe.ModelArgs.from_dict(config))  # bench_config is qwen3_moe

    def predicate(path, module):
        if "switch_mlp" in path or not hasattr(module, "to_quantized"):
            return False
        return quant.get(path, True)

    # The stacked experts' random init stays a lazy graph that is never evaluated.
    nn.quantize(model, group_size=group, bits=bits, class_predicate=predicate)
    resident = {k: v for k, v in tree_flatten(model.parameters()) if ".switch_mlp." not in k}
    resident = {
        k: (v.astype(mx_dtype) if mx.issubdtype(v.dtype, mx.floating) else v)
        for k, v in resident.items()
    }
    mx.eval(resident)

    layers = config["num_hidden_layers"]
    E, H, W = config["num_experts"], config["hidden_size"], config["moe_intermediate_size"]
    shards = layers
    names = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    weight_map: dict[str, str] = {}
    total = 0
    per_word = 32 // bits
    for layer in range(layers):
        tensors: dict[str, mx.array] = {}
        if layer == 0:
            tensors.update({k: v for k, v in resident.items() if ".layers." not in k})
        tensors.update({k: v for k, v in resident.items() if f".layers.{layer}." in k})
        for proj, (out_dim, in_dim) in (
            ("gate_proj", (W, H)),
            ("up_proj", (W, H)),
            ("down_proj", (H, W)),
        ):
            prefix = f"model.layers.{layer}.mlp.switch_mlp.{proj}"
            packed = rng.integers(0, 2**32, size=(E, out_dim, in_dim // per_word), dtype=np.uint32)
            # Dequantized weights ~ uniform(-1/sqrt(in), 1/sqrt(in)) with a little spread per group.
            levels = 2**bits - 1
            scale = (2.0 / (levels * np.sqrt(in_dim))) * (
                1.0 + 0.1 * rng.standard_normal((E, out_dim, in_dim // group), dtype=np.float32)
            )
            tensors[f"{prefix}.weight"] = mx.array(packed)
            tensors[f"{prefix}.scales"] = mx.array(scale.astype(np.float32)).astype(mx_dtype)
            tensors[f"{prefix}.biases"] = mx.array(
                (-levels / 2.0 * scale).astype(np.float32)
            ).astype(mx_dtype)
            del packed, scale
        mx.eval(tensors)
        mx.save_safetensors(str(dest / names[layer]), tensors, metadata={"format": "mlx"})
        for k, v in tensors.items():
            weight_map[k] = names[layer]
            total += v.nbytes
        del tensors
    (dest / "model.safetensors.index.json").write_text(
        json.dumps(
            {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
            indent=2,
        )
    )
    cfg = dict(config)
    cfg["torch_dtype"] = dtype
    (dest / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    return dest


# -- routing-trace analysis ------------------------------------------------------------------


def simulate(trace: list[list[set[int]]], slots: int, policy: str) -> tuple[int, int]:
    """(hits, misses) of one layer-by-layer trace [call][layer] -> experts, counted as the
    streamer counts them (each distinct expert of a call once), for a registered policy (with
    its default parameters) or "belady". The simulators are `moed trace analyze`'s, so both
    commands judge a cache the same way."""
    from moed.daemon.experts.policies import make_policy
    from moed.daemon.telemetry.analyze import BELADY, simulate_belady
    from moed.daemon.telemetry.analyze import simulate as replay

    hits = misses = 0
    layers = len(trace[0]) if trace else 0
    for layer in range(layers):
        calls = [np.array(sorted(call[layer]), dtype=np.int64) for call in trace]
        experts = 1 + max((max(c) for call in trace for c in call if c), default=0)
        h, m = (
            simulate_belady(calls, slots)
            if policy == BELADY
            else replay(calls, slots, make_policy(policy, experts, slots))
        )
        hits += h
        misses += m
    return hits, misses


# -- measurements ----------------------------------------------------------------------------


def raw_pread_bandwidth(model_path: Path, workers: int, sample_bytes: int, seed: int = 0) -> dict:
    """Parallel pread of expert-sized slices (every tensor of randomly chosen experts) with the
    page cache dropped, with the streamer's worker count: the bandwidth the store could reach."""
    from moed.daemon.experts.memory_plan import _EXPERT_TENSOR
    from moed.daemon.experts.safetensors_index import CheckpointIndex

    index = CheckpointIndex(model_path)
    owners: dict[str, list] = {}
    for name, loc in index.tensors.items():
        m = _EXPERT_TENSOR.match(name)
        if m:
            owners.setdefault(m.group("owner"), []).append(loc)
    pairs = [(owner, e) for owner, locs in owners.items() for e in range(locs[0].shape[0])]
    random.Random(seed).shuffle(pairs)
    jobs, total = [], 0
    for owner, e in pairs:
        for loc in owners[owner]:
            off, n = loc.expert_range(e)
            jobs.append((loc.file, off, n))
            total += n
        if total >= sample_bytes:
            break
    from moed.daemon.experts.store import drop_page_cache

    drop_page_cache(index.files)
    fds = {f: os.open(f, os.O_RDONLY) for f in index.files}
    for fd in fds.values():
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    bufs = [bytearray(max(n for _, _, n in jobs)) for _ in range(workers)]
    import threading

    local = threading.local()
    counter = iter(range(workers))
    lock = threading.Lock()

    def read(job):
        if not hasattr(local, "buf"):
            with lock:
                local.buf = memoryview(bufs[next(counter)])
        f, off, n = job
        got = os.preadv(fds[f], [local.buf[:n]], off)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fds[f], off, n, os.POSIX_FADV_DONTNEED)
        return got

    try:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=workers) as pool:
            done = sum(pool.map(read, jobs))
        wall = time.perf_counter() - t0
    finally:
        for fd in fds.values():
            os.close(fd)
    return {
        "bytes": done,
        "seconds": wall,
        "mb_s": done / wall / 1e6,
        "reads": len(jobs),
        "workers": workers,
    }


@dataclass
class RunResult:
    name: str
    slots: int = 0
    tokens: list[int] = field(default_factory=list)
    decode_tokens: int = 0
    decode_s: float = 0.0
    token_s: list[float] = field(default_factory=list)  # wall time of each decode token
    counters: dict = field(default_factory=dict)  # decode-phase deltas of the streamer's counters
    hits_total: int = 0
    misses_total: int = 0
    policy: str = ""
    policy_sim: tuple[int, int] = (0, 0)  # the streamer's policy replayed on its routing trace
    belady: tuple[int, int] = (0, 0)
    expert_bytes: int = 0

    @property
    def tok_s(self) -> float:
        """From the median token time: robust to other processes stealing the CPU for a while."""
        if not self.token_s:
            return self.decode_tokens / self.decode_s if self.decode_s else 0.0
        ordered = sorted(self.token_s)
        return 1.0 / ordered[len(ordered) // 2]


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
        res.hits_total, res.misses_total, res.expert_bytes = (
            end["hits"],
            end["misses"],
            end["expert_bytes"],
        )
        if self.simulate:
            trace = [[set(layer.tolist()) for layer in call] for call in self.streamer.trace]
            res.policy = self.streamer.cfg.cache_policy
            res.policy_sim = simulate(trace, res.slots, res.policy)
            res.belady = simulate(trace, res.slots, "belady")
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
    streamer.trace = []
    name = budget + ("+pre" if preload_all else "") + ("+spec" if speculative else "")
    return Contender(
        name, model, streamer, preloaded=preload_all, simulate=not (preload_all or speculative)
    )


def measure(
    contenders: list[Contender], files: list[Path], warm_prompt, prompt, warmup: int, tokens: int
) -> None:
    from moed.daemon.experts.store import drop_page_cache

    drop_page_cache(files)
    for c in contenders:
        c.warm_up(warm_prompt, warmup)
    for c in contenders:
        c.start(prompt, tokens)
    active = list(contenders)
    while active:
        active = [c for c in active if c.step()]


# -- report ----------------------------------------------------------------------------------


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b else "-"


def report(meta: dict, raw: dict, resident: RunResult, runs: list[RunResult]) -> str:
    lines = [
        f"moed bench stream: {meta['layers']} MoE layers x {meta['experts']} experts "
        f"(top-{meta['top_k']}), hidden {meta['hidden']}, "
        f"expert width {meta['width']}, {meta['bits']}-bit {meta['dtype']}; "
        f"one expert {meta['expert_bytes'] / 1e6:.2f} MB, "
        f"experts {meta['experts_bytes'] / 1e9:.2f} GB",
        f"decode {meta['tokens']} tokens after a {meta['warmup']}-token warm-up; "
        f"{raw['workers']} read workers; page cache: {meta['page_cache']}",
        f"raw parallel pread, page cache dropped: {raw['mb_s']:.0f} MB/s "
        f"(mean of {raw.get('before_mb_s', raw['mb_s']):.0f} before and "
        f"{raw.get('after_mb_s', raw['mb_s']):.0f} after the runs; "
        f"{raw['bytes'] / 1e6:.0f} MB in {raw['reads']} expert-tensor reads)",
        "",
        f"{'budget':>8} {'slots':>5} {'tok/s':>7} {'x res':>6} {'same':>5} "
        f"{'hit%':>6} {'belady%':>8} {'hit/opt':>7} "
        f"{'MB/tok':>7} {'B/(miss*E)':>10} {'read MB/s':>9} {'x raw':>6} {'syncs/tok':>9}",
        f"{'resident':>8} {'-':>5} {resident.tok_s:7.2f} {1.0:6.2f} {'-':>5}",
    ]
    for r in runs:
        c = r.counters
        hr = (
            r.hits_total / (r.hits_total + r.misses_total) if r.hits_total + r.misses_total else 0.0
        )
        bh, bm = r.belady
        opt = bh / (bh + bm) if bh + bm else 0.0
        if r.belady == (0, 0):  # preloaded or speculative: no offline optimum to compare with
            opt = 0.0
        mb_tok = c["bytes_read"] / r.decode_tokens / 1e6 if r.decode_tokens else 0.0
        exact = c["bytes_read"] / (c["misses"] * r.expert_bytes) if c["misses"] else 0.0
        moved = c["bytes_read"] + c.get("prefetch_bytes", 0)
        bw = moved / c["stall_s"] / 1e6 if c["stall_s"] and moved > 16 * r.expert_bytes else 0.0
        lines.append(
            f"{r.name:>8} {r.slots:5d} {r.tok_s:7.2f} {_ratio(r.tok_s, resident.tok_s):>6} "
            f"{'yes' if r.tokens == resident.tokens else 'NO':>5} "
            f"{100 * hr:6.1f} {(f'{100 * opt:.1f}' if opt else '-'):>8} "
            f"{(_ratio(hr, opt) if opt else '-'):>7} {mb_tok:7.1f} "
            f"{(f'{exact:.3f}' if exact else '-'):>10} "
            f"{(f'{bw:.0f}' if bw else '-'):>9} {(_ratio(bw, raw['mb_s']) if bw else '-'):>6} "
            f"{c['host_syncs'] / max(1, r.decode_tokens):9.2f}"
        )
    for r in runs:
        c = r.counters
        if c.get("prefetched"):
            lines.append(
                f"{r.name}: {c['prefetched']} experts prefetched for the next layer, "
                f"{100 * c['prefetch_hits'] / c['prefetched']:.0f}% "
                "of them used; with prefetch "
                f"{(c['bytes_read'] + c['prefetch_bytes']) / max(1, r.decode_tokens) / 1e6:.1f}"
                " MB/token read"
            )
    simulated = [r for r in runs if r.policy_sim != (0, 0)]
    sim_ok = all(r.policy_sim == (r.hits_total, r.misses_total) for r in simulated)
    lines.append(
        f"(a simulation of {', '.join(sorted({r.policy for r in simulated}))} on the same trace "
        f"{'reproduces' if sim_ok else 'DOES NOT reproduce'} the streamer's hits and misses)"
    )
    lines += [
        "",
        "time per decode token (ms):",
        f"{'budget':>8} {'wall':>7} {'sync':>11} {'fences':>8} {'readback':>8} "
        f"{'stall':>7} {'reads*':>7} "
        f"{'moe py':>7} {'other':>7}",
    ]
    lines.append(f"{'resident':>8} {1e3 * resident.decode_s / max(1, resident.decode_tokens):7.2f}")
    for r in runs:
        c, n = r.counters, max(1, r.decode_tokens)
        wall = r.decode_s / n
        sync, copy = c["router_sync_s"] / n, c["router_copy_s"] / n
        comp, stall, reads = c["expert_compute_s"] / n, c["stall_s"] / n, c["read_s"] / n
        moe_py = c["layer_python_s"] / n
        other = wall - c["layer_s"] / n
        lines.append(
            f"{r.name:>8} {1e3 * wall:7.2f} {1e3 * sync:11.2f} {1e3 * comp:8.2f} "
            f"{1e3 * copy:8.2f} {1e3 * stall:7.2f} "
            f"{1e3 * reads:7.2f} {1e3 * moe_py:7.2f} {1e3 * other:7.2f}"
        )
    lines += [
        "",
        "100%+pre: every expert preloaded before the warm-up (no cold misses): "
        "the streaming machinery's own cost.",
        "+spec: speculative next-layer prefetch (hits include prefetched experts; "
        "read MB/s: demand + prefetch",
        "bytes over the time stalled, so reads hidden behind compute push it above "
        "the raw bandwidth).",
        "same: greedy tokens identical to resident. hit%: all calls (warm-up + decode); "
        "belady%: offline optimum",
        "on the same routing trace and slots. B/(miss*E): decode bytes read / "
        "(misses x expert bytes).",
        "read MB/s: decode bytes read / time stalled on reads. syncs/tok: evaluations the "
        "streaming layers forced",
        "per decode token (router read-backs + fences). sync: the router read-backs, which "
        "evaluate everything pending",
        "(attention, router, the previous layer's experts); fences: evaluating pending outputs "
        "before a slot they read is",
        "reused; readback: copying indices to the host; reads*: worker time summed",
        "over parallel reads (inside the stall); moe py: the streaming layers' own Python "
        "(planning, slot tables,",
        "graph building); other: outside the streaming layers "
        "(generate_step, sampling, graph building).",
        "All models are loaded at once and decode interleaved token by token "
        "(same machine conditions);",
        "tok/s uses the median token time; the breakdown uses means.",
    ]
    return "\n".join(lines)


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
    seed,
) -> None:
    """Expert streaming vs resident mlx-lm on a model with Qwen3.6-35B-A3B expert shapes."""
    from moed.daemon.experts.prefetch import default_workers

    if dtype == "auto":
        import mlx.core as mx

        dtype = "bfloat16" if mx.metal.is_available() else "float32"
    config = bench_config(layers, hidden, expert_width, experts, top_k, vocab, bits=4, group=64)
    cleanup = model_dir is None
    path = Path(model_dir) if model_dir else Path(tempfile.mkdtemp(prefix="moed-bench-stream-"))
    try:
        existing = path / "config.json"
        if not (existing.exists() and _same_config(existing, config, dtype)):
            click.echo(f"writing the benchmark model to {path} ...", err=True)
            t0 = time.perf_counter()
            write_bench_model(path, config, dtype, seed)
            click.echo(f"  written in {time.perf_counter() - t0:.1f} s", err=True)
        workers = prefetch_workers or default_workers()
        warm_prompt, prompt = _prompt(seed + 1, vocab), _prompt(seed + 2, vocab)

        files = sorted(path.glob("model*.safetensors"))
        click.echo("raw parallel pread ...", err=True)
        raw_before = raw_pread_bandwidth(path, workers, raw_sample_mb * 10**6, seed)
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
            measure(contenders, files, warm_prompt, prompt, warmup, tokens)
            resident, *runs = [c.result() for c in contenders]
        finally:
            for c in contenders:
                c.close()
            del contenders
        click.echo("raw parallel pread again ...", err=True)
        raw_after = raw_pread_bandwidth(path, workers, raw_sample_mb * 10**6, seed + 1)
        raw = dict(raw_after)
        raw["mb_s"] = (raw_before["mb_s"] + raw_after["mb_s"]) / 2
        raw["bytes"] = raw_before["bytes"] + raw_after["bytes"]
        raw["reads"] = raw_before["reads"] + raw_after["reads"]
        raw["before_mb_s"], raw["after_mb_s"] = raw_before["mb_s"], raw_after["mb_s"]

        expert_bytes = runs[0].expert_bytes if runs else 0
        meta = {
            "layers": layers,
            "experts": experts,
            "top_k": top_k,
            "hidden": hidden,
            "width": expert_width,
            "bits": 4,
            "dtype": dtype,
            "expert_bytes": expert_bytes,
            "experts_bytes": expert_bytes * experts * layers,
            "tokens": tokens,
            "warmup": warmup,
            "page_cache": page_cache,
        }
        click.echo(report(meta, raw, resident, runs))
        if json_out:
            json_out.write_text(
                json.dumps(
                    {
                        "meta": meta,
                        "raw": raw,
                        "resident": asdict(resident),
                        "runs": [asdict(r) for r in runs],
                    },
                    indent=2,
                    default=list,
                )
            )
    finally:
        if cleanup:
            shutil.rmtree(path, ignore_errors=True)


def _same_config(path: Path, config: dict, dtype: str) -> bool:
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return saved == {**config, "torch_dtype": dtype}
