"""Routing statistics of an mlx-lm MoE over greedy generations, against uniform random routing.

    python -m training.routing_stats                   # the demo model, five prompts, 150 tokens
    python -m training.routing_stats --model PATH --tokens 150 --json

The recorder wraps each layer's `mlp.switch_mlp` and keeps the expert indices the router handed
it, so what is counted is exactly what the experts computed (whatever `switch_mlp` is: the stock
SwitchGLU or a streaming twin).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

PROMPTS = (
    "def fibonacci(n):",
    "import os\nimport sys\n\n",
    "class Queue:\n    def __init__(self, maxsize=0):",
    "# Copyright 2001 Python Software Foundation\n",
    'if __name__ == "__main__":',
)
TOP_FRACTION = 0.10  # "share of the most used experts" = share of the top 10% of experts


class _Recorder(nn.Module):
    def __init__(self, inner: nn.Module, sink: list):
        super().__init__()
        self.inner = inner
        self._sink = _Box(sink)

    def __call__(self, x, indices):
        self._sink.value.append(indices)
        return self.inner(x, indices)


class _Box:
    # A plain holder: nn.Module would treat a bare list attribute as a child container.
    def __init__(self, value):
        self.value = value


def moe_blocks(model: nn.Module) -> list[nn.Module]:
    """The MoE blocks (anything with a `switch_mlp`), in layer order."""
    return [layer.mlp for layer in model.layers if hasattr(layer.mlp, "switch_mlp")]


class RoutingRecorder:
    """Context manager that records the router's top-k indices of every MoE layer."""

    def __init__(self, model: nn.Module):
        self.blocks = moe_blocks(model)
        self.calls: list[list[mx.array]] = [[] for _ in self.blocks]

    def __enter__(self):
        for block, sink in zip(self.blocks, self.calls):
            block.switch_mlp = _Recorder(block.switch_mlp, sink)
        return self

    def __exit__(self, *exc):
        for block in self.blocks:
            block.switch_mlp = block.switch_mlp.inner

    def clear(self) -> None:
        for sink in self.calls:
            sink.clear()

    def per_token(self) -> list[np.ndarray]:
        """For each layer, an (n_tokens, k) array of expert ids in call order."""
        out = []
        for sink in self.calls:
            arrays = [np.array(a).reshape(-1, a.shape[-1]) for a in sink]
            out.append(np.concatenate(arrays) if arrays else np.zeros((0, 0), np.int64))
        return out


def greedy_routes(
    model, tokenizer, prompt: str, n_tokens: int = 150, temp: float = 0.0, seed: int = 0
):
    """Decode `n_tokens` and return (token ids, per-layer routes of those tokens).

    Greedy by default; `temp` > 0 samples (seeded). The routes are those taken when each
    generated token is fed back (the prompt's prefill is not counted). Decoding continues past
    EOS so every prompt yields exactly `n_tokens`.
    """
    from mlx_lm.models.cache import make_prompt_cache

    def pick(logits):
        if temp <= 0:
            return mx.argmax(logits).item()
        return mx.random.categorical(logits / temp).item()

    mx.random.seed(seed)
    cache = make_prompt_cache(model)
    ids = tokenizer.encode(prompt)
    with RoutingRecorder(model) as rec:
        logits = model(mx.array([ids]), cache=cache)
        rec.clear()
        tokens = []
        tok = pick(logits[0, -1])
        for _ in range(n_tokens):
            tokens.append(tok)
            logits = model(mx.array([[tok]]), cache=cache)
            tok = pick(logits[0, -1])
        routes = rec.per_token()
    return tokens, routes


@dataclass(frozen=True)
class LayerStats:
    unique: int  # distinct experts used over the tokens
    top_share: float  # share of the routed slots that went to the top 10% of experts
    reuse: float  # mean fraction of a token's experts also used by the previous token


def layer_stats(routes: np.ndarray, num_experts: int) -> LayerStats:
    k = routes.shape[1]
    counts = np.bincount(routes.ravel(), minlength=num_experts)
    top_share = _top_share(routes, num_experts)
    reuse = np.mean(
        [len(set(a) & set(b)) / k for a, b in zip(routes[1:].tolist(), routes[:-1].tolist())]
    )
    return LayerStats(int((counts > 0).sum()), float(top_share), float(reuse))


def uniform_baseline(num_experts: int, k: int, n_tokens: int, trials: int = 2000, seed: int = 0):
    """What routing each token to k distinct experts uniformly at random would give."""
    unique = num_experts * (1 - (1 - k / num_experts) ** n_tokens)
    rng = np.random.default_rng(seed)
    shares = []
    for _ in range(trials):
        routes = np.argsort(rng.random((n_tokens, num_experts)), axis=1)[:, :k]
        shares.append(_top_share(routes, num_experts))
    return LayerStats(unique=unique, top_share=float(np.mean(shares)), reuse=k / num_experts)


def _top_share(routes: np.ndarray, num_experts: int) -> float:
    counts = np.bincount(routes.ravel(), minlength=num_experts)
    n_top = max(1, round(TOP_FRACTION * num_experts))
    return float(np.sort(counts)[::-1][:n_top].sum() / counts.sum())


def measure(
    model, tokenizer, prompts=PROMPTS, n_tokens: int = 150, temp: float = 0.0, seed: int = 0
) -> dict:
    blocks = moe_blocks(model)
    num_experts, k = blocks[0].num_experts, blocks[0].top_k
    report = {
        "num_experts": num_experts,
        "top_k": k,
        "n_tokens": n_tokens,
        "temp": temp,
        "seed": seed,
        "prompts": [],
    }
    for prompt in prompts:
        tokens, routes = greedy_routes(model, tokenizer, prompt, n_tokens, temp, seed)
        layers = [layer_stats(r, num_experts) for r in routes]
        report["prompts"].append(
            {
                "prompt": prompt,
                "text": tokenizer.decode(tokens),
                "distinct_tokens": len(set(tokens)),
                "layers": [asdict(s) for s in layers],
            }
        )
    base = uniform_baseline(num_experts, k, n_tokens)
    report["uniform"] = asdict(base)
    every = [l for p in report["prompts"] for l in p["layers"]]
    report["mean"] = {key: float(np.mean([l[key] for l in every])) for key in asdict(base)}
    return report


def format_report(report: dict) -> str:
    E, k, T = report["num_experts"], report["top_k"], report["n_tokens"]
    n_top = max(1, round(TOP_FRACTION * E))
    how = (
        "greedy"
        if report["temp"] <= 0
        else f"sampled (temp {report['temp']}, seed {report['seed']})"
    )
    lines = [
        f"{T} {how} tokens per prompt, {E} experts, top-{k}; top share = share of routed slots "
        f"on the {n_top} most used experts ({TOP_FRACTION:.0%} of {E})",
        "",
        "| prompt | distinct tokens | unique experts per layer | top-10% share per layer | "
        "reuse per layer |",
        "|---|---|---|---|---|",
    ]
    for p in report["prompts"]:
        unique = " / ".join(str(l["unique"]) for l in p["layers"])
        share = " / ".join(f"{l['top_share']:.2f}" for l in p["layers"])
        reuse = " / ".join(f"{l['reuse']:.2f}" for l in p["layers"])
        prompt = repr(p["prompt"]).replace("|", "\\|")
        lines.append(f"| `{prompt}` | {p['distinct_tokens']} | {unique} | {share} | {reuse} |")
    m, u = report["mean"], report["uniform"]
    lines += [
        f"| **mean over prompts and layers** | | **{m['unique']:.1f}** | **{m['top_share']:.2f}** "
        f"| **{m['reuse']:.2f}** |",
        f"| uniform random routing (expected) | | {u['unique']:.2f} | {u['top_share']:.2f} | "
        f"{u['reuse']:.2f} |",
    ]
    return "\n".join(lines)


def main(argv=None) -> None:
    from mlx_lm import load

    from moed.daemon.model.demo import demo_model_path

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help="default: the embedded demo model")
    p.add_argument("--tokens", type=int, default=150)
    p.add_argument("--temp", type=float, default=0.0, help="0: greedy (default); >0: sample")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the full report as JSON")
    p.add_argument("--samples", action="store_true", help="also print each generation")
    p.add_argument(
        "--stream-budget",
        default=None,
        help="stream experts with this cache budget (e.g. 25%%) and report hits",
    )
    args = p.parse_args(argv)
    path = args.model or demo_model_path()
    streamer = None
    if args.stream_budget is None:
        model, tokenizer = load(str(path))
    else:
        from moed.daemon.experts import StreamingConfig, install_streaming

        model, tokenizer = load(str(path), lazy=True)
        # A fixed machine size, so the budget alone decides the slots.
        cfg = StreamingConfig(cache_budget=args.stream_budget, memory_bytes=8 << 30)
        streamer = install_streaming(model, path, cfg)
        mx.eval(model.parameters())
    report = measure(model, tokenizer, n_tokens=args.tokens, temp=args.temp, seed=args.seed)
    if streamer is not None:
        snap = streamer.snapshot()
        streamer.close()
        report["streaming"] = {k: snap[k] for k in ("slots_per_layer", "hits", "misses")}
        report["streaming"]["hit_rate"] = snap["hits"] / max(1, snap["hits"] + snap["misses"])
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(format_report(report))
    if "streaming" in report:
        st = report["streaming"]
        print(
            f"\nstreaming at {args.stream_budget}: {st['slots_per_layer']} slots per layer, "
            f"{st['hits']} hits, {st['misses']} misses, hit rate {st['hit_rate']:.1%} "
            "(prefills included)"
        )
    if args.samples:
        for p_ in report["prompts"]:
            print(f"\n--- {p_['prompt']!r}\n{p_['prompt']}{p_['text']}")


if __name__ == "__main__":
    main()
