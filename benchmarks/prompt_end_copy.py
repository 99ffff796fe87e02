"""A prompt's end with the rows moved to decoding (mlx_compat use 10) beside mlx-lm's own split,
which gathers a copy of every row's caches there: the time from the prompt's last chunk to the
first token, and the MLX memory that step adds, ROUNDS times alternating on one model in one
process (a qwen3_moe test checkpoint of 8 attention layers, written to a temporary folder).

    .venv/bin/python benchmarks/prompt_end_copy.py [CONTEXT_TOKENS]
"""

import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.utils import load_model

import moed.daemon.engine.batch as batch_module
from moed.daemon.engine.batch import DecodeBatch
from moed.daemon.engine.sampling import greedy
from moed.daemon.model import mlx_compat

sys.path.append(str(Path(__file__).resolve().parents[1]))  # the repository root: tests.fixtures
from tests.fixtures.checkpoints import write_checkpoint  # noqa: E402

ROUNDS = 5
VOCAB = 380  # below the test checkpoint's 384


def prompt_end(model, moved: bool, tokens: int) -> tuple[float, int, int]:
    """(seconds from the prompt read to the first token, MLX bytes that step added, the token)."""
    batch_module.move_whole_splits = mlx_compat.move_whole_splits if moved else (lambda gen: None)
    batch = DecodeBatch(model, [], 1, tokens)
    batch.insert([i % VOCAB + 1 for i in range(tokens)], 3, greedy)
    out = batch.step()  # the whole prompt but its last token, one chunk
    mx.eval([c.state for c in mlx_compat.prompt_batch(batch._gen).prompt_cache])
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    t0 = time.perf_counter()
    while not out.tokens:
        out = batch.step()  # the split, and the step of the prompt's last token
    seconds = time.perf_counter() - t0
    added = mx.get_peak_memory() - base
    batch.close()
    return seconds, added, out.tokens[0].token


def main() -> None:
    tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    with tempfile.TemporaryDirectory(prefix="prompt-end-") as folder:
        path = Path(folder) / "qwen3_moe"
        write_checkpoint(
            path, "qwen3_moe", num_layers=8, hidden=256, num_experts=8, top_k=2, expert_width=64
        )
        model, _ = load_model(path)  # loaded whole: the folder can go
    mx.eval(model.parameters())
    prompt_end(model, True, tokens)  # kernels warm
    runs: dict[bool, list[tuple[float, int, int]]] = {False: [], True: []}
    for _ in range(ROUNDS):
        for moved in (False, True):
            runs[moved].append(prompt_end(model, moved, tokens))
    first = {moved: {r[2] for r in rs} for moved, rs in runs.items()}
    assert first[False] == first[True], "the first token differs"
    took = {m: statistics.median(r[0] for r in rs) for m, rs in runs.items()}
    memory = {m: statistics.median(r[1] for r in rs) for m, rs in runs.items()}
    print(f"a {tokens}-token prompt's end (8 attention layers, median of {ROUNDS}):")
    for moved, name in ((False, "mlx-lm's split (copies)"), (True, "rows moved (use 10)")):
        print(f"  {name:24s} {took[moved] * 1e3:6.1f} ms, +{memory[moved] / 1e6:5.1f} MB")
    print(f"  moved / copied: {took[True] / took[False]:.2f}x time, first tokens equal")


if __name__ == "__main__":
    main()
