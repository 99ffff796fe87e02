"""The step that reads a prompt's last token, with and without reading its experts ahead
(daemon/experts/prompt_end.py): prompts of BODY random tokens that end alike (as a chat
template ends them), each read alone in one chunk through the engine's batch, on two streamed
models at BUDGET (one reading ahead, one not) and a resident one, taken in turn. Prints the
medians of that step's time, its demand misses and the engine's wait for reads.

    .venv/bin/python benchmarks/prompt_end_reads.py MODEL [BUDGET] [PAGE_CACHE] [BODY] [PROMPTS]
    .venv/bin/python benchmarks/prompt_end_reads.py /tmp/prefix-bench/qwen3_5_moe-h256 25% bypass
"""

import random
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx_lm

from moed.daemon.engine.batch import DecodeBatch
from moed.daemon.engine.sampling import greedy
from moed.daemon.experts import StreamingConfig, install_streaming

SUFFIX = [77, 12, 300, 5]  # the same end on every prompt


def load(model: Path, budget: str, page_cache: str):
    m, _ = mlx_lm.load(str(model), lazy=True)
    streamer = install_streaming(
        m, model, StreamingConfig(cache_budget=budget, page_cache=page_cache)
    )
    mx.eval(m.parameters())
    return m, streamer


def prompt_end_step(model, streamer, prompt: list[int], read_ahead: bool) -> tuple:
    """(ms, demand misses, ms waiting for reads) of the step reading the prompt's last token."""
    batch = DecodeBatch(
        model,
        [],
        max_batch=1,
        prefill_chunk=4096,
        unused_output=streamer.steps.unused_output,
        prompt_end=streamer.steps.prompt_end if read_ahead else None,
    )
    batch.insert(prompt, 2, greedy)
    batch.step()  # the chunk
    before = streamer.snapshot()
    t0 = time.perf_counter()
    assert batch.step().tokens
    ms = (time.perf_counter() - t0) * 1e3
    after = streamer.snapshot()
    batch.close()
    return ms, after["misses"] - before["misses"], (after["stall_s"] - before["stall_s"]) * 1e3


def main() -> None:
    args = sys.argv[1:]
    model = Path(args[0])
    budget = args[1] if len(args) > 1 else "25%"
    page_cache = args[2] if len(args) > 2 else "bypass"
    body = int(args[3]) if len(args) > 3 else 60
    count = int(args[4]) if len(args) > 4 else 40
    config = mlx_lm.utils.load_config(model)
    vocab = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size") or 384
    rng = random.Random(0)
    top = min(vocab, 1000) - 1
    prompts = [[rng.randrange(10, top) for _ in range(body)] + SUFFIX for _ in range(count)]
    sides = {
        "ahead": (*load(model, budget, page_cache), True),
        "not": (*load(model, budget, page_cache), False),
        "resident": (*load(model, "100%", page_cache), False),
    }
    results: dict[str, list[tuple]] = {name: [] for name in sides}
    names = list(sides)
    for i, prompt in enumerate(prompts):
        for name in names if i % 2 else reversed(names):
            m, streamer, ahead = sides[name]
            out = prompt_end_step(m, streamer, prompt, ahead)
            if i >= 4:  # the first prompt ends have nothing to repeat
                results[name].append(out)
    print(f"{model.name}: budget {budget}, page cache {page_cache}, {body}+{len(SUFFIX)} tokens")
    for name, rows in results.items():
        ms, misses, stall = (statistics.median(r[j] for r in rows) for j in range(3))
        print(
            f"{name:>9}  prompt-end step {ms:6.2f} ms  misses {misses:5.1f}  "
            f"waiting for reads {stall:5.2f} ms"
        )
    for _m, streamer, _ahead in sides.values():
        streamer.close()


if __name__ == "__main__":
    main()
