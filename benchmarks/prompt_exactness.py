"""First-token log-probabilities of a prompt read under streaming against the resident model's,
variant by variant, on whatever device MLX runs (a Mac's Metal, CUDA, this CPU): the resident
model twice (is the device deterministic?), then streamed at several budgets with the overlapped
decode path on and off. Reads as the daemon does (moed.daemon.bench.prompt._first_token).

    python benchmarks/prompt_exactness.py MODEL_DIR [PROMPT_TOKENS] [CHUNK]

MODEL_DIR: a checkpoint, e.g. the one `moed bench prompt --model-dir DIR` writes.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.utils import load_model

from moed.daemon.bench.prompt import _first_token
from moed.daemon.experts import StreamingConfig, install_streaming


def streamed(path: Path, prompt: list[int], chunk: int, budget: str, overlap: bool):
    model, _ = load_model(path, lazy=True)
    streamer = install_streaming(model, path, StreamingConfig(cache_budget=budget))
    try:
        mx.eval(model.parameters())
        if not overlap:  # the tuner probes from on: hold it off for this read
            streamer.hold_tuning()
        seconds, lp = _first_token(model, prompt, chunk, streamer.steps.unused_output)
        snap = streamer.snapshot()
        return seconds, lp, f"{snap['passes']} passes, {snap['overlapped']} overlapped"

    finally:
        streamer.close()


def resident(path: Path):
    model, _ = load_model(path)  # every weight in memory, as bench prompt's resident side
    return model


def compare(name: str, seconds: float, lp: mx.array, want: mx.array) -> None:
    diff = float(mx.max(mx.abs(lp - want)).item())
    same = bool(mx.array_equal(lp, want).item())
    top = int(mx.argmax(lp).item()) == int(mx.argmax(want).item())
    print(f"{name:<44} {seconds:8.3f} s  bit-identical {str(same):<5}  max |diff| {diff:.3e}  "
          f"same top token {top}")  # fmt: skip


def main() -> None:
    path = Path(sys.argv[1])
    tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 512
    chunk = int(sys.argv[3]) if len(sys.argv) > 3 else 128
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(3, 8000, size=tokens)]
    print(f"device {mx.default_device()}, prompt {tokens} tokens in chunks of {chunk}")
    # "overlap on" is as the daemon runs: the row-split probe turns it off where it is not exact.
    t0 = time.perf_counter()
    _, want = _first_token(resident(path), prompt, chunk)  # the first run warms the kernels
    print(f"resident, first run                          {time.perf_counter() - t0:8.3f} s")
    s, again = _first_token(resident(path), prompt, chunk)
    compare("resident, second run", s, again, want)
    for budget in ("100%", "25%", "10%"):
        for overlap in (True, False):
            s, lp, passes = streamed(path, prompt, chunk, budget, overlap)
            compare(f"{budget}, overlap {'on' if overlap else 'off'}, {passes}", s, lp, want)


if __name__ == "__main__":
    main()
