"""A prompt read under expert streaming with the pass lane (experts/pass_lane.py) on and off,
beside the resident model, in one process: ROUNDS rounds of the three, each a fresh model
reading REPEATS random prompts of TOKENS tokens as the daemon reads a prompt alone (each routes
to nearly every expert of every layer). Prints each side's median
time, its reads and the waits the streamer counted, and the ratios to resident.

    .venv/bin/python benchmarks/prompt_lane.py /tmp/prefix-bench/qwen3_5_moe-h256 [BUDGET] [TOKENS]
"""

import statistics
import sys
from contextlib import nullcontext
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.utils import load_model

from moed.daemon.bench.prompt import _first_token
from moed.daemon.experts import StreamingConfig, install_streaming
from moed.daemon.experts.store import PageCachePolicy

ROUNDS, REPEATS = 3, 8
KEYS = ("bytes_read", "stall_s", "expert_compute_s", "fences", "lane_loads")


def side(path: Path, budget: str | None, lane: bool, tokens: int, seed: int):
    """(seconds per prompt, counter deltas per prompt) of one side, on a fresh model."""
    model, _ = load_model(path, lazy=True)
    streamer = None
    if budget is not None:
        cfg = StreamingConfig(cache_budget=budget, page_cache=PageCachePolicy.TRUST)
        streamer = install_streaming(model, path, cfg)
        if not lane:
            streamer.drop_lane()
    mx.eval(model.parameters())
    rng = np.random.default_rng(seed)
    times, deltas = [], {k: [] for k in KEYS}
    try:
        for i in range(REPEATS + 1):  # the first warms MLX's kernels, not counted
            prompt = rng.integers(10, 200, size=tokens).tolist()
            before = streamer.snapshot() if streamer else {}
            scope = streamer.steps.unused_output if streamer else nullcontext
            seconds, _ = _first_token(model, prompt, 256, scope)
            if i == 0:
                continue
            times.append(seconds)
            after = streamer.snapshot() if streamer else {}
            for k in KEYS:
                if k in after:
                    deltas[k].append(after[k] - before[k])
    finally:
        if streamer is not None:
            streamer.close()
    return times, deltas


def main() -> None:
    path = Path(sys.argv[1])
    budget = sys.argv[2] if len(sys.argv) > 2 else "25%"
    tokens = int(sys.argv[3]) if len(sys.argv) > 3 else 128
    sides = {"resident": (None, False), "lane": (budget, True), "no lane": (budget, False)}
    times: dict[str, list[float]] = {s: [] for s in sides}
    deltas: dict[str, dict[str, list[float]]] = {s: {k: [] for k in KEYS} for s in sides}
    for r in range(ROUNDS):
        for name, (b, lane) in sides.items():
            t, d = side(path, b, lane, tokens, seed=r)
            times[name] += t
            for k in KEYS:
                deltas[name][k] += d[k]
    base = statistics.median(times["resident"])
    print(f"prompt of {tokens} tokens, budget {budget}, {ROUNDS}x{REPEATS} prompts each")
    for name in sides:
        m = statistics.median(times[name])
        row = f"{name:>9}  {m * 1e3:7.1f} ms  {m / base:5.2f}x resident"
        d = deltas[name]
        if d["bytes_read"]:
            row += (
                f"  read {statistics.median(d['bytes_read']) / 1e6:5.1f} MB"
                f"  read wait {statistics.median(d['stall_s']) * 1e3:4.1f} ms"
                f"  fence wait {statistics.median(d['expert_compute_s']) * 1e3:5.1f} ms"
                f"  fences {statistics.median(d['fences']):.0f}"
                f"  lane loads {statistics.median(d['lane_loads']):.0f}"
            )
        print(row)


if __name__ == "__main__":
    main()
